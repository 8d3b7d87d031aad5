"""DIR/input made once from the input files (a manifest of a corpus read in place, else an Arrow
dataset), checked (rows, ids, input.columns), and opened."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa

from batchinfer.errors import InputError
from batchinfer.inputs.columns import column_type
from batchinfer.inputs.datasets_reader import (
    dates_kept_as_text,
    read_error,
    read_jsonl_extended,
    read_with_datasets,
)
from batchinfer.inputs.idcheck import IdChunks, IdHashes, check_id_type, check_ids
from batchinfer.inputs.json_faults import big_integer_fault, huge_float_rows, non_finite_fault
from batchinfer.inputs.jsonl_stream import DATA_FILE, jsonl_to_arrow
from batchinfer.inputs.reference import (
    is_reference,
    manifest_ids,
    manifest_schema,
    plan_reference,
    write_manifest,
)
from batchinfer.inputs.referenced import open_reference
from batchinfer.inputs.textfiles import TypeConflict, text_lines
from batchinfer.security import remove_path


def convert_input(
    files: list[Path],
    fmt: str,
    dest: Path,
    id_column: Optional[str],
    columns: Optional[list[str]],
    strict_ids: bool = True,
    local_cache: bool = False,
) -> int:
    """Make dest the input tasks read, once; return its row count. A Parquet or Arrow corpus is
    referenced in place (dest holds a manifest of its files), other formats are converted into an
    Arrow dataset. With strict_ids=False null or duplicate ids are left for the caller to report
    (`batchinfer validate`). local_cache puts `datasets`' cache (and its file locks) in a node-local
    temporary folder instead of beside dest."""
    shown = str(files[0]) if len(files) == 1 else f"{files[0].parent}/ ({len(files)} files)"
    if all(f.is_file() and f.stat().st_size == 0 for f in files):
        raise InputError(f"{shown}: no rows (the file is empty); there is nothing to run")
    tmp = dest.with_name(dest.name + ".tmp")
    remove_path(tmp, ignore_errors=True)
    manifest = plan_reference(files, fmt)
    if manifest is not None:
        try:
            _check_input(
                shown,
                manifest["rows"],
                manifest_schema(manifest),
                id_column,
                columns,
                lambda: manifest_ids(manifest, id_column or ""),
                strict_ids,
            )
            write_manifest(dict(manifest, source=shown), tmp)
            os.replace(tmp, dest)
        finally:
            remove_path(tmp, ignore_errors=True)
        return manifest["rows"]
    if local_cache:
        cache = Path(tempfile.mkdtemp(prefix="batchinfer-convert-"))
    else:
        cache = dest.with_name(".hf-cache")
        remove_path(cache, ignore_errors=True)  # a symlink here would send datasets' cache outside DIR
    try:
        ds, hashed = None, None  # hashed: the ids' hashes, where the stream took them as it wrote them
        fast = jsonl_to_arrow(files, tmp, id_column) if fmt == "jsonl" else None
        if isinstance(fast, tuple):
            rows, schema, hashed = fast  # the id column is read again only to name a null or repeated id
            ids: IdChunks = lambda: _stream_column(tmp / DATA_FILE, schema.get_field_index(id_column or ""))  # noqa: E731
        else:
            remove_path(tmp, ignore_errors=True)
            try:
                ds = read_with_datasets(files, fmt, cache, shown, id_column)
            except InputError:
                raise
            except Exception as e:  # the readers raise ValueError, OSError, ArrowException, DatasetGenerationError
                if isinstance(fast, TypeConflict):  # what `datasets` could not cast either, by line and column
                    raise InputError(fast.message()) from None
                ds = read_jsonl_extended(files, cache) if fmt == "jsonl" and fast is None else None
                if ds is None:
                    raise read_error(files, fmt, shown, e) from None
            if fmt in ("jsonl", "json"):
                ds = dates_kept_as_text(ds, files, fmt)
            rows, schema = len(ds), ds.data.schema
            ids = lambda: ds.data.column(id_column).chunks  # noqa: E731
        if fmt == "jsonl" and id_column in schema.names and pa.types.is_floating(schema.field(id_column).type):
            _refuse_inexact_ids(files, id_column)
        if fmt in ("jsonl", "json"):
            batches = ds.data.table.to_batches() if ds is not None else _stream_batches(tmp / DATA_FILE)
            fault = big_integer_fault(files, fmt, schema, huge_float_rows(batches))
            fault = fault or (non_finite_fault(files, fmt, ds.features) if ds is not None else None)
            if fault:
                raise InputError(fault)
        _check_input(shown, rows, schema, id_column, columns, ids, strict_ids, hashed)
        if ds is not None:
            ds.save_to_disk(str(tmp))
        os.replace(tmp, dest)
        return rows
    finally:
        remove_path(cache, ignore_errors=True)
        remove_path(tmp, ignore_errors=True)


def _check_input(
    shown: str,
    rows: int,
    schema: pa.Schema,
    id_column: Optional[str],
    columns: Optional[list[str]],
    ids: IdChunks,
    strict_ids: bool,
    hashed: Optional[IdHashes] = None,
) -> None:
    """Rows present, the id column there (and its ids unique with strict_ids), input.columns there.
    hashed: the ids' hashes, where they were taken as the ids were written."""
    if rows == 0:
        raise InputError(f"{shown}: no rows; there is nothing to run")
    if id_column is not None:
        if id_column not in schema.names:
            raise InputError(
                f"{shown}: input.id_column={id_column!r} is not a column (columns: {', '.join(schema.names)})"
            )
        check_id_type(shown, schema.field(id_column).type, ids, id_column)
        if strict_ids:
            check_ids(shown, ids, id_column, hashed)
    for col in columns or []:
        column_type(schema, col, shown)


def _refuse_inexact_ids(files: list[Path], id_column: str) -> None:
    """JSON lines ids read as floats although some are integers (one beyond 64 bits, or decimals
    beside them) would not keep their value and type (2 -> 2.0, 2**53 + 1 -> 2**53): InputError
    naming the line. Only read where the id column came out as floats."""
    decimal: Optional[str] = None
    integer: Optional[tuple[str, int]] = None
    for path in files:
        for lineno, line in text_lines(path):
            value = json.loads(line).get(id_column) if line.strip() else None
            if isinstance(value, float) and decimal is None:
                decimal = f"{path}:{lineno}"
            if not isinstance(value, int) or isinstance(value, bool):
                continue
            if not -(1 << 63) <= value < 1 << 63:
                raise InputError(
                    f"{path}:{lineno}: id {value} is an integer beyond 64 bits, which would make every id a float "
                    f"(exact only to 2**53, so distinct ids could collide); write the ids as JSON strings "
                    f'("{value}")'
                )
            integer = integer or (f"{path}:{lineno}", value)
            if decimal is not None:
                break
    if integer is not None and decimal is not None:
        raise InputError(
            f"{integer[0]}: id {integer[1]} is an integer but the id at {decimal} is a decimal: the column would "
            f"hold floats ({integer[1]} read as {float(integer[1])}); write every id as an integer, or all as JSON strings"
        )


def _stream_batches(path: Path) -> Iterable[pa.RecordBatch]:
    """The record batches of an Arrow stream file, memory-mapped: a pass over some of its columns
    touches only their pages."""
    with pa.memory_map(str(path)) as f:
        yield from pa.ipc.open_stream(f)


def _stream_column(path: Path, at: int) -> Iterable[pa.Array]:
    """Column `at` of an Arrow stream file, batch by batch, memory-mapped: only its pages are read."""
    for batch in _stream_batches(path):
        yield batch.column(at)


def open_input(dest: Path) -> Any:
    """DIR/input as a dataset: the corpus it refers to (each file checked unchanged when first read),
    or the converted copy memory-mapped."""
    if is_reference(dest):
        return open_reference(dest)
    import datasets

    datasets.disable_progress_bars()
    return datasets.load_from_disk(str(dest))
