"""CSV/TSV records checked to hold as many cells as the header names columns: pandas (`datasets`'
CSV reader) takes a first record with one more cell as an index column and shifts every value
of the file one column left, and fills a record with fewer cells with empty strings. pyarrow's
reader finds such a record (~0.1 s per 75 MB); the csv module names its line only then."""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa

from batchinfer.errors import InputError
from batchinfer.inputs.compressed import open_text


def check_cells(path: Path, sep: str, columns: int) -> None:
    """InputError naming file:line of the first record whose cells are not `columns` (the header's)."""
    import pyarrow.csv as pcsv

    odd: list[Any] = []

    def note(row: Any) -> str:  # pyarrow's InvalidRow: the cells it expected and found, no line number
        odd.append(row)
        return "skip"

    names = [f"c{i}" for i in range(columns)]
    with open_text(path) as f:
        reader = pcsv.open_csv(
            f,
            read_options=pcsv.ReadOptions(block_size=1 << 22, skip_rows=1, column_names=names),
            parse_options=pcsv.ParseOptions(delimiter=sep, newlines_in_values=True, invalid_row_handler=note),
            convert_options=pcsv.ConvertOptions(include_columns=names[:1], column_types={names[0]: pa.string()}),
        )
        for _ in reader:
            if odd:
                break
    if not odd:
        return
    found = _first_odd_line(path, sep, columns)
    line, cells = found if found else ("", odd[0].actual_columns)
    what = "a tab" if sep == "\t" else f"{sep!r}"
    raise InputError(
        f"{path}:{line}: {cells} cell{'s' * (cells != 1)} but the header names {columns} columns (a record must "
        f"have one cell per column); quote a cell holding {what} or a newline, or fix the record"
    )


def _first_odd_line(path: Path, sep: str, columns: int) -> Optional[tuple[int, int]]:
    """(line where it starts, cells) of the first record as the csv module reads it with another
    number of cells than columns; None where it finds none."""
    with open_text(path) as f:
        text = io.TextIOWrapper(f, encoding="utf-8-sig", errors="replace", newline="")
        reader = csv.reader(text, delimiter=sep)
        next(reader, None)
        start = reader.line_num + 1
        for record in reader:
            if record and len(record) != columns:
                return start, len(record)
            start = reader.line_num + 1
    return None
