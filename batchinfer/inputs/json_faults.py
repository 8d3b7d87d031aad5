"""Where a JSON input goes wrong, by file:line: what the readers refused (a key given twice in one
object, a number no 64-bit type holds: they say "row 0" of a block, or a character position), a
JSON document that is no list of rows (checked before the readers, which crash on some), and the
values the readers would change without a word (an integer beyond 64 bits in a column of floats,
NaN or Infinity in a column kept as JSON text). The last are looked for only where the types read
allow them, and only on lines a byte pattern picks out: good input pays a pass over its floats."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa

from batchinfer.errors import InputError
from batchinfer.inputs.textfiles import MAX_JSON_DEPTH, json_kind, line_chunks, scan_jsonl, text_lines

# A JSON string (skipped) or a number literal, to find out-of-range integers in a JSON document.
_STRING_OR_NUMBER = re.compile(r'"(?:[^"\\]|\\.)*"|-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?')
INT_RANGE = (-(1 << 63), 1 << 64)  # the integers ujson (`datasets`' reader of JSON documents) takes
INT64 = (-(1 << 63), 1 << 63)  # the integers pyarrow's JSON reader keeps as integers (the rest: floats)
# Lines that may hold an integer of 19 digits or more, or a number no 64-bit float holds.
_LONG_DIGITS = re.compile(rb"[0-9]{19}")
_NON_FINITE = re.compile(rb"NaN|Infinity|[0-9][eE]\+?[0-9]{3}")
# A JSON string (skipped) or bracket, to find where a document nests too deep.
_STRING_OR_BRACKET = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


class _Fault(ValueError):
    """What is wrong with one JSON value, said for the user."""


def jsonl_fault(files: list[Path]) -> Optional[str]:
    """`file:line: what; what to do` for the first JSON lines row with a key twice in one object or a
    number too big for a 64-bit float, or None. A pass over the files: only run once a reader failed."""
    for path in files:
        for lineno, line in text_lines(path):
            if not line.strip():
                continue
            try:
                json.loads(line, object_pairs_hook=_unique_keys, parse_float=_finite_float)
            except _Fault as e:
                return f"{path}:{lineno}: {e}"
            except (ValueError, RecursionError):
                continue  # not JSON: the line-by-line check says so
    return None


def json_document_fault(path: Path) -> Optional[str]:
    """`file:line:column: ...` for the first integer literal of a JSON document outside what its
    reader holds (ujson: -2**63 to 2**64 - 1), or None."""
    text = "".join(line for _, line in text_lines(path))
    for m in _STRING_OR_NUMBER.finditer(text):
        literal = m.group()
        if literal.startswith('"') or not literal.lstrip("-").isdigit():
            continue
        if not INT_RANGE[0] <= int(literal) < INT_RANGE[1]:
            line = text.count("\n", 0, m.start()) + 1
            column = m.start() - text.rfind("\n", 0, m.start())
            short = literal if len(literal) <= 40 else literal[:20] + "..."
            return (
                f"{path}:{line}:{column}: the integer {short} does not fit 64 bits; write it as a JSON string "
                f'("{short}") or a decimal'
            )
    return None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) < len(pairs):
        twice = next(k for i, (k, _) in enumerate(pairs) if k in (p[0] for p in pairs[:i]))
        raise _Fault(f"key {twice!r} appears twice in one object; remove or rename one")
    return obj


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        short = text if len(text) <= 40 else text[:20] + "..."
        raise _Fault(f'the number {short} is too big for a 64-bit float; write it as a JSON string ("{short}")')
    return value


# ---------------------------------------------------------------- a JSON document's shape


def json_document_shape_fault(path: Path) -> Optional[str]:
    """`file:line: ...` where a JSON document is no list of rows `datasets` reads as such: not an
    array of objects (or of strings), nor objects one per line; None where it is. pyarrow's reader,
    which `datasets` hands the items to as lines, crashes the process on a `null` among them."""
    from batchinfer.inputs.object_lines import objects_only

    text = "".join(line for _, line in text_lines(path))
    start = len(text) - len(text.lstrip(" \t\r\n"))
    if start == len(text):
        return f"{path}: no rows (only whitespace); there is nothing to run"
    if text[start] == "{" and objects_only(text.encode()):
        return None  # JSON lines, which `datasets` reads as such
    try:
        doc = json.loads(text)
    except RecursionError:
        deep = _too_deep(path, text, MAX_JSON_DEPTH + (text[start] == "["))
        return deep or f"{path}: objects and lists nested too deep to read; flatten them"
    except ValueError:
        if text[start] == "{":  # objects one per line, one of the lines not: named by the line-by-line check
            try:
                scan_jsonl(path)
            except InputError as e:
                return str(e)
        return None  # not JSON: the reader's own error, said by read_error
    if isinstance(doc, dict):
        return None  # one object: one row
    if not isinstance(doc, list):
        return (
            f"{path}:{_line(text, start)}: the document is {json_kind(doc)}, not rows: a JSON input is an array "
            '(one object per row, [{"text": ...}, ...]) or one object per line'
        )
    want = dict if doc and isinstance(doc[0], dict) else str
    odd = next((k for k, item in enumerate(doc) if not isinstance(item, want)), None)
    if odd is None:
        return None
    rows = "objects (one per row)" if want is dict else "strings (the text of each row)"
    return (
        f"{path}:{_item_line(text, start, odd)}: item {odd} of the array is {json_kind(doc[odd])}; its items must all be "
        f"{rows}, as the first is: fix or remove that item"
    )


def _item_line(text: str, start: int, k: int) -> int:
    """The line where item k of the array at text[start] starts (only run to name a bad item)."""
    decoder = json.JSONDecoder()
    at = start + 1
    for _ in range(k + 1):
        while text[at] in " \t\r\n,":
            at += 1
        item_start = at
        _, at = decoder.raw_decode(text, at)
    return _line(text, item_start)


def _too_deep(path: Path, text: str, limit: int) -> Optional[str]:
    """The message for a document nesting objects and lists deeper than limit, naming the line; None
    where it does not."""
    depth = 0
    for m in _STRING_OR_BRACKET.finditer(text):
        depth += {"[": 1, "{": 1, "]": -1, "}": -1}.get(m.group(), 0)
        if depth > limit:
            return (
                f"{path}:{_line(text, m.start())}: objects and lists nested more than {MAX_JSON_DEPTH} levels deep "
                f"(the row's own object counts as one); at most {MAX_JSON_DEPTH} can be read: flatten the value or "
                "write it as JSON text (a quoted string)"
            )
    return None


def document_depth_fault(path: Path) -> Optional[str]:
    """`_too_deep`'s message where a JSON document nests deeper than a row may, else None (only run
    once a reader refused it)."""
    text = "".join(line for _, line in text_lines(path))
    return _too_deep(path, text, MAX_JSON_DEPTH + (text.lstrip(" \t\r\n")[:1] == "["))


def _line(text: str, at: int) -> int:
    return text.count("\n", 0, at) + 1


# ---------------------------------------------------------------- values the readers would change


def huge_float_rows(batches: Iterable[pa.RecordBatch]) -> list[int]:
    """The rows (counted over all batches) with a float of magnitude 2**63 or more anywhere in them:
    where an integer beyond 64 bits may have been read as a float. Columns without floats cost nothing."""
    import numpy as np

    rows: list[int] = []
    base = 0
    for batch in batches:
        hit = np.zeros(batch.num_rows, bool)
        for column in batch.columns:
            if _has_float(column.type):
                hit |= _huge(column)
        rows.extend((base + np.flatnonzero(hit)).tolist())
        base += batch.num_rows
    return rows


def _has_float(t: pa.DataType) -> bool:
    if pa.types.is_floating(t):
        return True
    if pa.types.is_struct(t):
        return any(_has_float(t.field(i).type) for i in range(t.num_fields))
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return _has_float(t.value_type)
    return False


def _huge(arr: pa.Array) -> Any:
    """Per element of arr: whether it holds a float of magnitude >= 2**63 (a numpy bool array)."""
    import numpy as np
    import pyarrow.compute as pc

    if pa.types.is_floating(arr.type):
        big = pc.greater_equal(pc.abs(arr.cast(pa.float64())), float(1 << 63))
        return big.fill_null(False).to_numpy(zero_copy_only=False)
    hit = np.zeros(len(arr), bool)
    if pa.types.is_struct(arr.type):
        for i in range(arr.type.num_fields):
            if _has_float(arr.type.field(i).type):
                hit |= _huge(arr.field(i))
    elif (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)) and _has_float(arr.type.value_type):
        items = _huge(arr.flatten())
        if items.any():
            parents = pc.list_parent_indices(arr).to_numpy()
            hit[np.unique(parents[items])] = True
    return hit


def big_integer_fault(files: list[Path], fmt: str, schema: pa.Schema, rows: list[int]) -> Optional[str]:
    """`file:line: ...` for the first of rows (from `huge_float_rows`) holding an integer beyond
    64 bits in a column read as floats (which would keep neither its value nor the column's other
    integers as written), or None where each such float was written as one."""
    if not rows:
        return None
    want = set(rows)
    struct = pa.struct(schema)
    if fmt == "json":
        base = 0
        for path in files:
            text = "".join(line for _, line in text_lines(path))
            doc = json.loads(text)
            items = doc if isinstance(doc, list) else [doc]
            found = _big_integer_in_document(path, text, items, struct, sorted(r - base for r in want if r >= base))
            if found:
                return found
            base += len(items)
        return None
    row = 0
    for path in files:
        for lineno, line in text_lines(path):
            if not line.strip(" \t\r\n"):
                continue
            if row in want and _LONG_DIGITS.search(line.encode()):
                found = _big_int_at(json.loads(line), struct, ())
                if found:
                    return _big_integer_message(f"{path}:{lineno}", *found)
            row += 1
            if row > rows[-1]:
                return None
    return None


def _big_integer_in_document(
    path: Path, text: str, items: list[Any], struct: pa.DataType, rows: list[int]
) -> Optional[str]:
    """`big_integer_fault` for one JSON document's items (rows counted from its first)."""
    for k in (r for r in rows if r < len(items)):
        found = _big_int_at(items[k], struct, ())
        if found:
            column, value = found
            for m in _STRING_OR_NUMBER.finditer(text):
                if m.group() == str(value):
                    return _big_integer_message(f"{path}:{_line(text, m.start())}", column, value)
            return _big_integer_message(str(path), column, value)
    return None


def _big_int_at(value: Any, t: pa.DataType, path: tuple[str, ...]) -> Optional[tuple[str, int]]:
    """(column, integer) of the first integer beyond 64 bits where value's type t is a float."""
    if pa.types.is_floating(t):
        if isinstance(value, int) and not isinstance(value, bool) and not INT64[0] <= value < INT64[1]:
            return ".".join(path), value
        return None
    if pa.types.is_struct(t) and isinstance(value, dict):
        for f in t:
            found = _big_int_at(value.get(f.name), f.type, (*path, f.name))
            if found:
                return found
    if (pa.types.is_list(t) or pa.types.is_large_list(t)) and isinstance(value, list):
        for item in value:
            found = _big_int_at(item, t.value_type, path)
            if found:
                return found
    return None


def _big_integer_message(where: str, column: str, value: int) -> str:
    short = str(value) if len(str(value)) <= 40 else str(value)[:20] + "..."
    return (
        f"{where}: column {column!r} holds the integer {short}, beyond 64 bits: the column would be read as "
        f'floats ({short} as {float(value)!r}); write such numbers as JSON strings ("{short}")'
    )


class _NonFinite:
    """A number JSON text cannot hold (NaN, Infinity, one past a 64-bit float), as written."""

    def __init__(self, text: str) -> None:
        self.text = text


def _number(text: str) -> Any:
    value = float(text)
    return _NonFinite(text) if value in (float("inf"), float("-inf")) else value


def non_finite_fault(files: list[Path], fmt: str, features: Any) -> Optional[str]:
    """`file:line: ...` for the first NaN, Infinity or number past a 64-bit float that `datasets`
    would write as null: in JSON lines, inside a column it keeps as JSON text; in a JSON document,
    anywhere (its items pass through JSON text). None where none; lines without such a literal
    (a byte pattern) are not parsed."""
    if fmt == "jsonl":
        paths = _json_text_paths(features)
        if not paths:
            return None
    for path in files:
        for first, chunk in line_chunks(path, 8 << 20):
            if not _NON_FINITE.search(chunk):
                continue
            if fmt == "json":
                found = _non_finite_in_document(path, first, chunk.decode("utf-8", "replace"))
                if found:
                    return found
                continue
            for offset, raw in enumerate(chunk.split(b"\n")):
                if not _NON_FINITE.search(raw):
                    continue
                try:
                    row = json.loads(raw, parse_constant=_NonFinite, parse_float=_number)
                except (ValueError, RecursionError):
                    continue
                for json_path in paths:
                    found = _non_finite_at(row, json_path)
                    if found is not None:
                        return _non_finite_message(f"{path}:{first + offset}", str(json_path[0]), found.text)
    return None


def _json_text_paths(features: Any) -> list[list[Any]]:
    """Where `datasets` keeps values as JSON text (its Json features), as its own paths: keys, and 0
    for a list's items."""
    try:
        from datasets.utils.json import get_json_field_paths_from_feature
    except ImportError:
        return []
    return [p for p in get_json_field_paths_from_feature(features) if p]


def _non_finite_at(value: Any, json_path: list[Any]) -> Optional[_NonFinite]:
    if json_path:
        key, *rest = json_path
        if key == 0:
            items = value if isinstance(value, list) else []
            return next(filter(None, (_non_finite_at(x, rest) for x in items)), None)
        return _non_finite_at(value.get(key), rest) if isinstance(value, dict) else None
    if isinstance(value, _NonFinite):
        return value
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        return next(filter(None, (_non_finite_at(x, []) for x in value)), None)
    return None


_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|NaN|-?Infinity|-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?')


def _non_finite_in_document(path: Path, first: int, text: str) -> Optional[str]:
    for m in _TOKEN.finditer(text):
        token = m.group()
        if token.startswith('"'):
            continue
        if "N" in token or "I" in token or isinstance(_number(token), _NonFinite):
            return _non_finite_message(f"{path}:{first + text.count(chr(10), 0, m.start())}", None, token)
    return None


def _non_finite_message(where: str, column: Optional[str], literal: str) -> str:
    short = literal if len(literal) <= 40 else literal[:20] + "..."
    if column:
        what = f"column {column!r} (kept as JSON text: its objects' keys differ from row to row) holds"
    else:
        what = "the document (whose rows are read through JSON text) holds"
    return (
        f"{where}: {what} the number {short}, which JSON text cannot hold: it would be read as null; "
        f'write it as a JSON string ("{short}") or a finite number'
    )
