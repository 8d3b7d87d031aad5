"""Table files: a table as a Parquet or JSONL file's bytes and back, and the row-group size."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Optional

import pyarrow as pa
import pyarrow.parquet as pq

from batchinfer.rundir.schema import jsonl_to_table, table_to_jsonl

# Row groups of a compacted Parquet file: compaction writes one at a time and merge streams them,
# so the memory of either is one group, not a shard. At most this many rows, and about
# GROUP_BYTES of rows (long outputs: fewer rows), never fewer than MIN_GROUP_ROWS.
ROW_GROUP_ROWS = 65536
GROUP_BYTES = 32 << 20
MIN_GROUP_ROWS = 1024


def table_bytes(table: pa.Table, fmt: str, row_group_size: Optional[int] = None) -> bytes:
    """Encode a table as a Parquet or JSONL file's bytes."""
    if fmt == "jsonl":
        return table_to_jsonl(table)
    buf = io.BytesIO()
    # No dictionary pages: a part's big columns are unique strings (ids, answers, digests), where a
    # dictionary is built and then dropped for each, and the file is ~3x larger with zstd (10,000 rows
    # of short answers: 104 KB, 35 KB without); writing took ~2x the CPU. Parts written with
    # dictionaries (runs before this) read the same.
    pq.write_table(table, buf, compression="zstd", use_dictionary=False, row_group_size=row_group_size)
    return buf.getvalue()


def read_table(path: Path, schema: pa.Schema, columns: Optional[list[str]] = None) -> pa.Table:
    """Read one part or output file back in the run's schema."""
    if path.suffix == ".jsonl":
        table = jsonl_to_table(path.read_bytes(), schema)
        return table.select(columns) if columns else table
    return pq.read_table(path, columns=columns, schema=schema if columns is None else None)


def group_rows(row_bytes: float) -> int:
    """Rows of a compacted row group (and of a compaction or merge window) for rows of this size."""
    return min(ROW_GROUP_ROWS, max(MIN_GROUP_ROWS, int(GROUP_BYTES // max(row_bytes, 1.0))))
