"""Inputs read by `datasets`' own builders: every format, and JSON lines its first chunk's types do not
fit, read with those types extended over every row; its errors said as file:line."""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional, Union

import pyarrow as pa
import pyarrow.compute as pc

from batchinfer.errors import InputError
from batchinfer.inputs.compressed import open_text
from batchinfer.inputs.csv_cells import check_cells
from batchinfer.inputs.formats import FORMATS
from batchinfer.inputs.json_faults import (
    document_depth_fault,
    json_document_fault,
    json_document_shape_fault,
    jsonl_fault,
)
from batchinfer.inputs.openai_batch import convert_requests
from batchinfer.inputs.textfiles import (
    TypeConflict,
    TypesDiffer,
    csv_header,
    dates_as_text,
    extend_feature,
    find_conflict,
    json_type,
    line_chunks,
    scan_jsonl,
    text_lines,
    unify_types,
)

log = logging.getLogger("batchinfer")

# `datasets`' JSON builder takes its types from the first 10 MB of the first file and casts the rest to
# them; the fast path reads that chunk first and streams every file with its types. Passed to the
# builder (its own default, checked by a test) so that the two always agree.
DATASETS_CHUNK_BYTES = 10 << 20


def read_with_datasets(
    files: list[Path], fmt: str, cache_dir: Path, shown: str, id_column: Optional[str] = None
) -> Any:
    """The input as `datasets`' builder for its format reads it (its cache in cache_dir); a CSV/TSV
    cell of id_column that is empty is a null id (one that is missing, as in JSON lines)."""
    import datasets

    datasets.disable_progress_bars()
    # Its "Failed to read file" log lines would precede our own message about the same failure.
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    names = [str(f) for f in files]
    cache = str(cache_dir)
    if fmt in ("jsonl", "openai") and sum(scan_jsonl(f) for f in files) == 0:
        raise InputError(f"{shown}: no rows (only blank lines); there is nothing to run")
    if fmt == "openai":
        cache_dir.mkdir(parents=True, exist_ok=True)
        convert_requests(files, cache_dir / "requests.parquet", open_text)
        return datasets.Dataset.from_parquet(str(cache_dir / "requests.parquet"), cache_dir=cache)
    if fmt == "json":  # before the reader: pyarrow, which it hands the items to, crashes on some
        fault = next(filter(None, map(json_document_shape_fault, files)), None)
        if fault:
            raise InputError(fault)
    if fmt in ("jsonl", "json"):
        return datasets.Dataset.from_json(names, cache_dir=cache, chunksize=DATASETS_CHUNK_BYTES)
    if fmt in ("csv", "tsv"):
        # Cells are the strings they are: pandas' guesses would make `007` the number 7 (and a
        # duplicate of `7`), `1e3` 1000.0, and the texts NA, null, N/A, nan nulls. Only an empty id
        # cell is null: an id that is not there.
        sep = "\t" if fmt == "tsv" else ","
        headers = [csv_header(f, sep) for f in files]  # each file's, for its duplicate names
        for f, header in zip(files, headers, strict=True):
            check_cells(f, sep, len(header))
        strings = datasets.Features({name: datasets.Value("string") for name in headers[0]})
        return datasets.Dataset.from_csv(
            names,
            cache_dir=cache,
            sep=sep,
            features=strings,
            keep_default_na=False,
            na_filter=id_column is not None,
            na_values={id_column: [""]} if id_column is not None else None,
        )
    if fmt == "parquet":
        return datasets.Dataset.from_parquet(names, cache_dir=cache, **_columns_datasets_holds(files[0]))
    if fmt == "arrow":
        return datasets.load_dataset("arrow", data_files=names, split="train", cache_dir=cache)
    if fmt == "hf_disk":
        return datasets.load_from_disk(names[0])
    raise InputError(f"input.format={fmt!r} is not supported ({', '.join(FORMATS)})")


def _columns_datasets_holds(path: Path) -> dict[str, Any]:
    """`from_parquet`'s columns and features for the columns of a Parquet file `datasets` can hold
    ({}: all of them), the others (maps) left out with a warning: a column no setting uses does not
    refuse the file; a setting that names one is told the column is not there."""
    import datasets
    import pyarrow.parquet as pq

    schema = pq.read_schema(path)
    kept = []
    for field in schema:
        try:
            datasets.Features.from_arrow_schema(pa.schema([field]))
            kept.append(field)
        except (TypeError, ValueError, NotImplementedError, pa.ArrowException):
            log.warning("%s: column %r (%s) is left out: it has no `datasets` type", path, field.name, field.type)
    if len(kept) == len(schema):
        return {}
    return {"columns": [f.name for f in kept], "features": datasets.Features.from_arrow_schema(pa.schema(kept))}


def dates_kept_as_text(ds: Any, files: list[Path], fmt: str) -> Any:
    """A JSON lines or JSON dataset read by `datasets`, whose columns holding ISO date strings pyarrow
    made timestamps ("2024-02-29" -> 2024-02-29 00:00:00) read again from the files as the text they are."""
    import datasets
    from datasets.table import InMemoryTable

    table = ds.data.table
    dated = [f for f in table.schema if not dates_as_text(f.type).equals(f.type)]
    if not dated:
        return ds
    features = dict(ds.features)
    for field in dated:
        typ = dates_as_text(field.type)
        try:
            values = [_field(row, field.name) for row in _json_rows(files, fmt)]
            column = pa.chunked_array([pa.array(values, type=typ)], type=typ)
        except (pa.ArrowException, ValueError, TypeError) as e:
            raise InputError(
                f"{files[0]}: column {field.name!r} holds ISO dates inside values whose other parts cannot be "
                f"read again as text ({e}); write its dates as other text or flatten the column"
            ) from None
        table = table.set_column(table.schema.get_field_index(field.name), field.with_type(typ), column)
        features[field.name] = datasets.features.features.generate_from_arrow_type(typ)
    info = datasets.DatasetInfo(features=datasets.Features(features))
    return datasets.Dataset(InMemoryTable(table), info=info)


def _json_rows(files: list[Path], fmt: str) -> Iterator[Any]:
    """The rows of JSON lines files (one a line with content) or JSON documents (a list each), parsed."""
    for path in files:
        if fmt == "jsonl":
            yield from (json.loads(line) for _, line in text_lines(path) if line.strip())
        else:
            yield from json.loads("".join(line for _, line in text_lines(path)))


def _field(row: Any, name: str) -> Any:
    """A row's value of a column; a JSON document's list of strings is read as a column `text`."""
    return row.get(name) if isinstance(row, dict) else (row if name == "text" else None)


def read_error(files: list[Path], fmt: str, shown: str, e: Exception) -> InputError:
    """An unreadable input, said as file:line where the cause is bad UTF-8, else in the reader's words."""
    if fmt in ("csv", "tsv", "json"):
        for f in files:  # the readers name no line for bad UTF-8; this pass only runs on failure
            for _ in text_lines(f):
                pass
    while e.__cause__ is not None and "error occurred while generating" in str(e):
        e = e.__cause__  # datasets wraps the reader's own error in a message that says nothing
    reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
    # pyarrow names a row of its block ("row 0"), ujson a character: the line, where it is one of these
    fault = jsonl_fault(files) if fmt in ("jsonl", "openai") else None
    if fmt == "json" and re.search(r"Value is too (big|small)", reason):
        fault = next(filter(None, map(json_document_fault, files)), None)
    if fmt == "json" and re.search(r"depth limit|[Rr]ecursion|nesting", reason):
        fault = next(filter(None, map(document_depth_fault, files)), None)
    if fault:
        return InputError(fault)
    if "corresponds to no data" in reason:  # datasets' words for a header-only CSV
        return InputError(f"{shown}: no rows (only a header); there is nothing to run")
    return InputError(f"{shown}: cannot be read as {fmt} ({reason}); check the file or set input.format")


def read_jsonl_extended(files: list[Path], cache: Path) -> Any:
    """JSON lines that `datasets` refused under its first chunk's types, read by `datasets` with those
    types extended over every row (`_extended_features`); None where that does not help (the first
    error stands). A value it cannot cast is named by file:line and column."""
    import datasets

    features = _extended_features(files, cache / "first-chunk")
    if isinstance(features, TypeConflict):
        raise InputError(features.message())
    if features is None:
        return None
    try:
        return datasets.Dataset.from_json(
            [str(f) for f in files], cache_dir=str(cache), features=features, chunksize=DATASETS_CHUNK_BYTES
        )
    except Exception:  # as in read_with_datasets: the readers raise many kinds
        return None


def _extended_features(files: list[Path], scratch: Path) -> Union[Any, TypeConflict, None]:
    """The `datasets` Features its JSON builder takes from the first chunk (JSON text columns
    included), extended by `extend_feature` with every later chunk of every file as the builder reads
    it; the first value the builder could not cast to them, by file:line; None where nothing changed,
    a chunk cannot be read, or this `datasets` has no such reading."""
    import datasets

    try:
        from datasets.packaged_modules.json.json import AGENT_TRACES_FEATURES
        from datasets.utils.json import get_json_field_paths_from_feature
    except ImportError:
        return None
    scratch.mkdir(parents=True, exist_ok=True)
    head = scratch / "first-chunk.jsonl"
    head.write_bytes(first_chunk(files[0]))
    try:  # the builder itself on the same bytes: its types, JSON text columns and all
        first = datasets.Dataset.from_json(str(head), cache_dir=str(scratch), chunksize=DATASETS_CHUNK_BYTES).features
    except Exception:
        return None
    if first == AGENT_TRACES_FEATURES:
        return None
    paths = get_json_field_paths_from_feature(first)
    features = first
    for k, path in enumerate(files):
        for line, chunk in line_chunks(path, DATASETS_CHUNK_BYTES):
            if k == 0 and line == 1:
                continue  # the chunk the types come from
            read = _read_as_datasets(chunk, paths)
            if read is None:
                return None
            table, mixed = read
            features = extend_feature(features, pa.struct(table.schema))
            refused = _refused_column(table, features)
            if refused is None:
                continue
            if any(p and p[0] == refused for p in mixed):  # its values are all JSON text here: kinds tell
                one = pa.schema([(refused, _json_as_null(features.arrow_schema.field(refused).type))])
                return find_conflict(path, line, _projected(chunk, refused), one)
            return _refused_line(path, line, chunk, table[refused], refused, features)
    return None if features == first else features


def _read_as_datasets(chunk: bytes, paths: list[list[Any]]) -> Optional[tuple[pa.Table, list[list[Any]]]]:
    """A later chunk read as `datasets`' JSON builder reads it: the fields at paths (its JSON text
    columns) encoded as JSON text, and a field whose type changes within the chunk too, its path
    added to paths for this chunk and the rest (as the builder does); the table and the paths added
    here; None where pyarrow cannot read it for another reason."""
    import pyarrow.json as paj
    from datasets.utils.json import (
        get_json_field_path_from_pyarrow_json_error,
        insert_json_field_path,
        json_encode_fields_in_json_lines,
        ujson_loads,
    )

    before = [list(p) for p in paths]
    while True:
        try:
            batch = json_encode_fields_in_json_lines(chunk, paths) if paths else chunk
            table = paj.read_json(io.BytesIO(batch), read_options=paj.ReadOptions(block_size=len(batch) + 1))
            return table, [p for p in paths if p not in before]
        except pa.ArrowInvalid as e:
            if "changed from" not in str(e):
                return None
            try:
                examples = (ujson_loads(line) for line in chunk.splitlines())
                field = get_json_field_path_from_pyarrow_json_error(str(e), examples=examples)
            except ValueError:
                return None
            if not field or any(field[: len(p)] == p for p in paths):
                return None
            insert_json_field_path(paths, field)
        except (pa.ArrowException, ValueError):
            return None


def _projected(chunk: bytes, name: str) -> bytes:
    """chunk's lines as objects of the one column `name` (lines kept in place, blank ones blank)."""
    return b"\n".join(
        json.dumps({name: json.loads(raw).get(name)}).encode() if raw.strip() else b"" for raw in chunk.split(b"\n")
    )


def _refused_column(table: pa.Table, features: Any) -> Optional[str]:
    """The first column of a chunk's table that `datasets` cannot cast to its feature, or None."""
    from datasets import Value
    from datasets.table import cast_array_to_feature

    schema = features.arrow_schema
    for name in table.column_names:
        column, feature = table[name], features[name]
        if column.type.equals(schema.field(name).type):
            continue
        if pa.types.is_struct(column.type) and feature == Value("string"):
            continue  # the builder writes these objects as JSON text
        try:
            cast_array_to_feature(column, feature)
        except (pa.ArrowException, TypeError, ValueError):
            return name
    return None


def _refused_line(
    path: Path, first_line: int, chunk: bytes, column: pa.ChunkedArray, name: str, features: Any
) -> Optional[TypeConflict]:
    """The line of chunk (lines of path from first_line on) whose value of column `name` `datasets`
    cannot cast to its feature: the shortest prefix of its values (nulls cast to anything) that does
    not cast ends there."""
    from datasets.table import cast_array_to_feature

    whole, feature = column.combine_chunks(), features[name]
    array, at = whole.drop_null(), pc.indices_nonzero(whole.is_valid()).to_pylist()
    if not len(array):
        return None

    def casts(n: int) -> bool:
        try:
            cast_array_to_feature(array.slice(0, n), feature)
            return True
        except (pa.ArrowException, TypeError, ValueError):
            return False

    good, bad = 0, len(array)
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if casts(mid) else (good, mid)
    rows = (i for i, raw in enumerate(chunk.split(b"\n")) if raw.strip(b" \t\r"))
    offset = next(i for n, i in enumerate(rows) if n == at[bad - 1])
    value = json.loads(chunk.split(b"\n")[offset]).get(name)
    before = _json_as_null(features.arrow_schema.field(name).type)
    try:  # the field inside the column where the kinds differ
        unify_types(before, json_type(value, (name,)), (name,))
    except TypesDiffer as e:
        return TypeConflict(path, first_line + offset, e.path, e.before, e.found)
    return TypeConflict(path, first_line + offset, (name,), before, json_type(value))


def _json_as_null(t: pa.DataType) -> pa.DataType:
    """A type with its JSON text parts (which hold any value) as null, which joins anything."""
    if isinstance(t, pa.BaseExtensionType):
        return pa.null()
    if pa.types.is_struct(t):
        return pa.struct([(f.name, _json_as_null(f.type)) for f in t])
    if pa.types.is_list(t):
        return pa.list_(_json_as_null(t.value_type))
    return t


def first_chunk(path: Path) -> bytes:
    """The bytes `datasets`' JSON builder takes its types from: the first 10 MB and the rest of that
    line, a UTF-8 BOM dropped."""
    return first_chunk_and_rest(path)[0]


def first_chunk_and_rest(path: Path) -> tuple[bytes, int, bool]:
    """`first_chunk`, how many bytes of the (decompressed) file it took (a BOM included), and whether
    the file goes on after it."""
    with open_text(path) as f:
        head = f.read(DATASETS_CHUNK_BYTES)
        head += f.readline()
        more = bool(f.read(1))
    return head.removeprefix(b"\xef\xbb\xbf"), len(head), more
