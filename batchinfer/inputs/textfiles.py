"""Reading text inputs line by line: compressed files, UTF-8 with file:line errors, JSON lines checks,
and the one type each JSON lines column takes over all rows."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa

from batchinfer.errors import InputError
from batchinfer.inputs.compressed import COMPRESSION_SUFFIXES, open_text

# A \uD800-\uDFFF escape: half of a UTF-16 pair (checked further only where one appears).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
# Objects and lists nested deeper than this (the row's own object counted) are past what Arrow's
# schemas hold (pyarrow refuses at 64) and what Python's recursion takes further down.
MAX_JSON_DEPTH = 63
# pyarrow's JSON type inference crashes the process (its stack) somewhere past 10,000 levels: lines
# with more opening brackets than this are measured before it sees them.
ARROW_SAFE_DEPTH = 1000
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKET = re.compile(r"[\[\]{}]")


def first_line(path: Path) -> str:
    """The first non-empty line of a (possibly compressed) text file, or ''."""
    try:
        with open_text(path) as f:
            for raw in f:
                if raw.strip():
                    return raw.decode("utf-8", errors="replace").removeprefix("\ufeff")
    except (OSError, InputError):
        pass  # the reading that follows says what is wrong with the file
    return ""


def text_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of a (possibly compressed) UTF-8 file, a leading BOM dropped; a line that is
    not UTF-8 raises InputError naming file:line and the byte."""
    offset = 0
    compressed = path.name.lower().endswith(COMPRESSION_SUFFIXES)
    with open_text(path) as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                # Offsets in a compressed file would point into its decompressed text: the line is enough.
                where = "" if compressed else f", file offset {offset + e.start}"
                raise InputError(
                    f"{path}:{lineno}: invalid UTF-8 at byte {e.start} of the line{where}; re-encode the file as UTF-8"
                ) from None
            offset += len(raw)
            yield lineno, line.removeprefix("\ufeff") if lineno == 1 else line


def json_object(path: Path, lineno: int, line: str) -> dict[str, Any]:
    """One JSON lines row; errors name file:line."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        # json's words end in "at" where they name a position ("Unterminated string starting at").
        at = "" if e.msg.endswith(" at") else " at"
        raise InputError(
            f"{path}:{lineno}: not valid JSON ({e.msg}{at} column {e.colno}); fix or remove the line"
        ) from None
    except RecursionError:
        obj = None  # nested too deep for Python: said below
    if obj is None or line.count("[") + line.count("{") > MAX_JSON_DEPTH:
        deepest = json_depth(line)
        if deepest > MAX_JSON_DEPTH:
            raise InputError(
                f"{path}:{lineno}: objects and lists nested {deepest} levels deep (the row's own object counts "
                f"as one); at most {MAX_JSON_DEPTH} can be read: flatten the value or write it as JSON text (a quoted string)"
            )
    if not isinstance(obj, dict):
        raise InputError(
            f"{path}:{lineno}: expected a JSON object per line, got {json_kind(obj)}; write the row as one "
            'object ({"text": ...}) or remove the line'
        )
    if _SURROGATE_ESCAPE.search(line):
        _refuse_lone_surrogates(path, lineno, obj)
    return obj


def json_kind(value: Any) -> str:
    """What a parsed JSON value is, in JSON's words: null, true, a number, a string, an array, an object."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, (int, float)):
        return "a number"
    return {str: "a string", list: "an array", dict: "an object"}[type(value)]


def nests_deeper(chunk: bytes, depth: int) -> bool:
    """Whether a line of JSON lines nests objects and lists deeper than depth; only lines with that
    many opening brackets are looked at closely (found with numpy: a loop over the lines of a 10 MB
    chunk of short lines would take a tenth of a second)."""
    import numpy as np

    data = np.frombuffer(chunk, np.uint8)
    starts = np.concatenate(([0], np.flatnonzero(data == 10) + 1))
    if len(chunk) - starts[-1] <= depth and (len(starts) < 2 or np.diff(starts).max() <= depth):
        return False  # no line holds that many bytes
    opening = np.flatnonzero((data == ord("[")) | (data == ord("{")))
    per_line = np.bincount(np.searchsorted(starts, opening, side="right") - 1, minlength=len(starts))
    ends = np.append(starts[1:] - 1, len(chunk))
    return any(
        json_depth(chunk[starts[i] : ends[i]].decode("utf-8", "replace")) > depth
        for i in np.flatnonzero(per_line > depth)
    )


def json_depth(text: str) -> int:
    """How deep objects and lists nest in a JSON text (brackets inside strings aside)."""
    from itertools import accumulate

    brackets = _BRACKET.findall(_JSON_STRING.sub("", text))
    return max(accumulate(1 if b in "[{" else -1 for b in brackets), default=0)


def _refuse_lone_surrogates(path: Path, lineno: int, obj: dict[str, Any]) -> None:
    """InputError naming file:line and the field where a string holds half a UTF-16 pair (not text)."""
    for key, value in obj.items():
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            bad = e.object[e.start : e.end]
            raise InputError(
                f"{path}:{lineno}: field {key!r} holds a lone UTF-16 surrogate ({bad.encode('unicode_escape').decode()}), "
                "which is not text; replace it (e.g. with \\ufffd) or remove it"
            ) from None


def scan_jsonl(path: Path) -> int:
    """Check every line decodes and parses; return the row count. Errors name file:line."""
    rows = 0
    for lineno, line in text_lines(path):
        if line.strip():
            json_object(path, lineno, line)
            rows += 1
    return rows


def csv_header(path: Path, sep: str) -> list[str]:
    """The column names on a CSV/TSV file's first line (a UTF-8 BOM dropped); a name given twice
    raises InputError (the readers would keep one of the two columns without a word), as does one
    left empty."""
    import csv
    import io

    with open_text(path) as f:
        head = io.TextIOWrapper(f, encoding="utf-8-sig", errors="replace", newline="")
        names = next(csv.reader(head, delimiter=sep), [])
    for i, name in enumerate(names):
        if not name.strip():
            end = f" (a header ending in {sep!r} makes an empty last one)" if i == len(names) - 1 else ""
            raise InputError(f"{path}:1: column {i + 1} of the header has no name{end}; name every column")
        if name in names[:i]:
            raise InputError(
                f"{path}:1: the header names column {name!r} twice (columns {names.index(name) + 1} and {i + 1}); "
                "give each column its own name"
            )
    return names


# ---------------------------------------------------------------- one type per JSON lines column


class TypesDiffer(ValueError):
    """Two types of one column that no promotion joins; path names the column, "[]" a list's items."""

    def __init__(self, path: tuple[str, ...], before: pa.DataType, found: pa.DataType):
        super().__init__(f"{'.'.join(path)}: {before} and {found}")
        self.path, self.before, self.found = path, before, found


def unify_types(before: pa.DataType, found: pa.DataType, path: tuple[str, ...] = ()) -> pa.DataType:
    """The type a column takes when some rows give it `before` and others `found`: null joins anything,
    integers and decimals make decimals, text and ISO dates (pyarrow reads those as timestamps) make
    text, objects take every key seen (null where a row lacks one), lists their items' joined type;
    anything else raises TypesDiffer naming the column."""
    if before.equals(found):
        return before
    if pa.types.is_null(before):
        return found
    if pa.types.is_null(found):
        return before
    if _is_number(before) and _is_number(found):
        return pa.float64()
    if _is_text(before) and _is_text(found):
        return pa.string()
    if pa.types.is_struct(before) and pa.types.is_struct(found):
        fields = {f.name: f.type for f in before}
        for f in found:
            fields[f.name] = unify_types(fields[f.name], f.type, (*path, f.name)) if f.name in fields else f.type
        return pa.struct(list(fields.items()))
    if pa.types.is_list(before) and pa.types.is_list(found):
        return pa.list_(unify_types(before.value_type, found.value_type, (*path, "[]")))
    raise TypesDiffer(path, before, found)


def unify_schemas(before: pa.Schema, found: pa.Schema) -> pa.Schema:
    """One schema for rows read as `before` and rows read as `found` (columns in order of first sight)."""
    return pa.schema(list(unify_types(pa.struct(before), pa.struct(found))))


def dates_as_text(t: Any) -> Any:
    """A schema or type with the timestamps pyarrow's JSON reader infers for ISO date strings as
    strings: read under it, such a value keeps its own text ("2024-02-29" stays so)."""
    if isinstance(t, pa.Schema):
        return pa.schema([f.with_type(dates_as_text(f.type)) for f in t], metadata=t.metadata)
    if pa.types.is_timestamp(t):
        return pa.string()
    if pa.types.is_struct(t):
        return pa.struct([f.with_type(dates_as_text(f.type)) for f in t])
    if pa.types.is_list(t):
        return pa.list_(t.value_field.with_type(dates_as_text(t.value_type)))
    return t


def _is_number(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t)


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_timestamp(t)


def json_type(value: Any, path: tuple[str, ...] = ()) -> pa.DataType:
    """The Arrow type pyarrow's JSON reader gives one parsed JSON value (ISO dates aside: text); a
    list whose items no promotion joins raises TypesDiffer (path: where the value is)."""
    if value is None:
        return pa.null()
    if isinstance(value, bool):
        return pa.bool_()
    if isinstance(value, int):
        return pa.int64() if -(1 << 63) <= value < 1 << 63 else pa.float64()
    if isinstance(value, float):
        return pa.float64()
    if isinstance(value, str):
        return pa.string()
    if isinstance(value, list):
        item = pa.null()
        for x in value:
            item = unify_types(item, json_type(x, (*path, "[]")), (*path, "[]"))
        return pa.list_(item)
    return pa.struct([(k, json_type(v, (*path, k))) for k, v in value.items()])


@dataclass(frozen=True)
class TypeConflict:
    """A JSON lines value whose type no promotion joins with the type its column has in the rows before."""

    file: Path
    line: int
    column: tuple[str, ...]
    before: pa.DataType
    found: pa.DataType

    def message(self) -> str:
        """The error the user sees: file:line, column, both kinds and what to do."""
        column = ".".join(p for p in self.column if p != "[]")
        inside = " (inside a list)" if "[]" in self.column else ""
        # Inside a list the values before may be this row's own.
        where = "before it" if inside else "in the rows before"
        before, found = _KINDS[_kind(self.before)], _KINDS[_kind(self.found)]
        if "text" in (before[0], found[0]):
            other = found[1] if before[0] == "text" else before[1]
            fix = (
                f"write the {other} of that column as JSON text (quoted strings), or move them to a column of their own"
            )
        else:
            fix = "make that column's values one kind in every row, or move the odd ones to a column of their own"
        return (
            f"{self.file}:{self.line}: column {column!r}{inside} holds {found[0]} here but {before[1]} {where}; "
            f"a column takes one type over all rows and files (integers and decimals make decimals, a "
            f"missing key is null, nothing else mixes): {fix}"
        )


# A kind of JSON value: (one, several).
_KINDS = {
    "number": ("a number", "numbers"),
    "text": ("text", "texts"),
    "bool": ("true/false", "true/false values"),
    "list": ("a list", "lists"),
    "object": ("an object", "objects"),
}


def _kind(t: pa.DataType) -> str:
    """A type as the kind of JSON value it holds (a key of _KINDS)."""
    if _is_number(t):
        return "number"
    if _is_text(t):
        return "text"
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_list(t):
        return "list"
    return "object"


def find_conflict(path: Path, first_line: int, chunk: bytes, schema: pa.Schema) -> Optional[TypeConflict]:
    """The first line of chunk (lines of path from first_line on) whose value does not join the
    types of schema and of the chunk's lines before it; None where none (or a line is not a JSON
    object: the line-by-line scan names that)."""
    seen = pa.struct(schema)
    for offset, raw in enumerate(chunk.split(b"\n")):
        if not raw.strip():
            continue
        try:
            value = json.loads(raw)
        except ValueError:
            return None
        if not isinstance(value, dict):
            return None
        try:
            seen = unify_types(seen, json_type(value))
        except TypesDiffer as e:
            return TypeConflict(path, first_line + offset, e.path, e.before, e.found)
    return None


def line_chunks(path: Path, size: int) -> Iterator[tuple[int, bytes]]:
    """(first line number, bytes) of about `size` bytes of whole lines at a time, a leading BOM dropped."""
    line = 1
    with open_text(path) as f:
        while chunk := f.read(size):
            chunk += f.readline()
            if line == 1:
                chunk = chunk.removeprefix(b"\xef\xbb\xbf")
            yield line, chunk
            line += chunk.count(b"\n")


def extend_feature(before: Any, found: pa.DataType) -> Any:
    """A `datasets` feature (as its JSON builder typed a column) widened to also hold values pyarrow
    reads as `found`: keys first seen there become nullable fields, integers that meet decimals make
    decimals, ISO dates that meet other text make text, an all-null column takes the new type;
    anything else keeps `before` (JSON text holds any value; `datasets` casts or refuses the rest)."""
    from datasets import Json, List, Value
    from datasets.features.features import generate_from_arrow_type

    if isinstance(before, Json) or pa.types.is_null(found):
        return before
    if before == Value("null"):
        return generate_from_arrow_type(found)
    if isinstance(before, dict) and pa.types.is_struct(found):
        fields = dict(before)
        for f in found:
            fields[f.name] = (
                extend_feature(fields[f.name], f.type) if f.name in fields else generate_from_arrow_type(f.type)
            )
        return type(before)(fields)
    if isinstance(before, List) and before.length == -1 and pa.types.is_list(found):
        return List(extend_feature(before.feature, found.value_type))
    if isinstance(before, Value):
        was = before.pa_type
        if pa.types.is_integer(was) and pa.types.is_floating(found):
            return Value("float64")
        if pa.types.is_timestamp(was) and _is_text(found):
            return Value("string")
    return before
