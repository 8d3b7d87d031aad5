"""Count an input's rows and read a spread sample of them, without converting it (for `batchinfer plan`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from batchinfer.errors import InputError
from batchinfer.inputs.compressed import open_text
from batchinfer.inputs.openai_batch import request_row
from batchinfer.inputs.reference import plan_reference
from batchinfer.inputs.referenced import ReferencedInput
from batchinfer.inputs.textfiles import csv_header, json_object, text_lines

PEEK_BATCH_BYTES = 1 << 20  # a sample needs a row or two of each row group it touches


def spread(rows: int, k: int) -> list[int]:
    """k row indices spread evenly over rows (all of them when rows <= k)."""
    k = min(k, rows)
    return [i * rows // k for i in range(k)]


def _line_files(files: list[Path], fmt: str, k: int) -> tuple[int, list[dict[str, Any]]]:
    # Two cheap passes: count non-blank lines, then parse only the chosen ones.
    counts = []
    for path in files:
        with open_text(path) as f:
            counts.append(sum(1 for raw in f if raw.strip()))
    wanted = set(spread(sum(counts), k))
    sample: list[dict[str, Any]] = []
    base = 0
    for path, n in zip(files, counts, strict=True):
        if wanted & set(range(base, base + n)):
            row = base
            for lineno, line in text_lines(path):
                if not line.strip():
                    continue
                if row in wanted:
                    obj = json_object(path, lineno, line)
                    sample.append(request_row(obj, f"{path}:{lineno}") if fmt == "openai" else obj)
                row += 1
        base += n
    return sum(counts), sample


def _table(files: list[Path], fmt: str) -> Any:
    import pyarrow as pa

    if fmt in ("csv", "tsv"):
        import pyarrow.csv as pcsv

        sep = "\t" if fmt == "tsv" else ","
        opts = pcsv.ParseOptions(delimiter=sep, newlines_in_values=True)

        def strings(f: Path) -> Any:  # as the conversion reads them: every cell a string, never a null
            types = {name: pa.string() for name in csv_header(f, sep)}
            return pcsv.ConvertOptions(column_types=types, strings_can_be_null=False, null_values=[])

        return pa.concat_tables(
            [pcsv.read_csv(open_text(f), parse_options=opts, convert_options=strings(f)) for f in files]
        )
    if fmt == "parquet":
        import pyarrow.dataset as pds

        return pds.dataset([str(f) for f in files], format="parquet")
    if fmt == "arrow":
        tables = []
        for f in files:
            source = pa.memory_map(str(f))
            try:
                tables.append(pa.ipc.open_file(source).read_all())
            except pa.ArrowInvalid:  # datasets writes the stream format
                tables.append(pa.ipc.open_stream(pa.memory_map(str(f))).read_all())
        return pa.concat_tables(tables)
    if fmt == "hf_disk":
        import datasets

        return datasets.load_from_disk(str(files[0])).data.table
    if fmt == "json":
        items = [item for f in files for item in _json_array(f)]
        return pa.Table.from_pylist(items)
    raise InputError(f"input.format={fmt!r}: plan cannot read it")


def _json_array(path: Path) -> list[dict[str, Any]]:
    with open_text(path) as f:
        data = json.loads(f.read())
    if not isinstance(data, list) or not all(isinstance(x, dict) for x in data):
        raise InputError(f"{path}: expected a JSON array of objects")
    return data


def _in_place(files: list[Path], fmt: str, k: int) -> Optional[tuple[int, list[dict[str, Any]]]]:
    """A Parquet or Arrow corpus as `run` reads it: rows counted from the footers, the sample read from
    the row groups that hold it (each decoded once, in small batches); None where `run` converts it."""
    manifest = plan_reference(files, fmt)
    if manifest is None:
        return None
    ds = ReferencedInput(files[0], manifest, batch_bytes=PEEK_BATCH_BYTES)
    return len(ds), ds.select(spread(len(ds), k)).to_list()


def peek(files: list[Path], fmt: str, k: int = 200) -> tuple[int, list[dict[str, Any]]]:
    """The input's row count and up to k rows spread over it, as dicts (nested fields as dicts)."""
    try:
        if fmt in ("jsonl", "openai"):
            return _line_files(files, fmt, k)
        found = _in_place(files, fmt, k)
        if found is not None:
            return found
        table = _table(files, fmt)
        rows = table.count_rows() if hasattr(table, "count_rows") else table.num_rows
        return rows, table.take(spread(rows, k)).to_pylist()
    except InputError:
        raise
    except (OSError, ValueError) as e:  # pyarrow's errors are ValueErrors
        if fmt in ("csv", "tsv") and "invalid UTF8" in str(e):
            for f in files:  # pyarrow names no line: name it as validate and the run do
                for _ in text_lines(f):
                    pass
        shown = files[0] if len(files) == 1 else f"{files[0].parent}/ ({len(files)} files)"
        raise InputError(f"{shown}: cannot be read as {fmt} ({str(e).splitlines()[0][:300]})") from None
