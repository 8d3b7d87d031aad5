"""A shard's committed rows for merge: in row order, each once, streamed a row group or window at
a time and checked to be exactly its range."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchinfer.errors import RunDirError
from batchinfer.inputs.shards import Shard
from batchinfer.rundir.schema import jsonl_columns, jsonl_to_table
from batchinfer.rundir.shard_folder import UNREAD
from batchinfer.rundir.shardrows import ShardRows, keep_mask_sorted, line_blocks, take_lines
from batchinfer.rundir.store import RunDir
from batchinfer.rundir.tables import group_rows

log = logging.getLogger("batchinfer")


# JSON lines of a compacted shard are copied to a JSONL output in blocks of about this size.
READ_BLOCK_BYTES = 8 << 20


@dataclass
class Rows:
    """Some rows of a shard in input order: a table of them or, when `lines` is set, the committed
    JSON lines themselves with a table of only the columns stats read (row included)."""

    table: pa.Table
    lines: Optional[bytes] = None


def stat_columns(run: RunDir) -> list[str]:
    """The columns merge's stats read (and `row`, for the order check)."""
    wanted = ("row", "prompt_tokens", "output_tokens", "error", "finish_reason")
    return [c for c in wanted if c in run.schema.names]


def shard_rows_in_order(run: RunDir, shard: Shard, done: Any = UNREAD) -> Iterator[Rows]:
    """A shard's committed rows in row order, each once, streamed, checked as they come to be exactly
    its range: a later copy of a row is dropped as sealing drops it (the first copy kept, logged),
    a missing row refuses the merge. done: the shard's DONE.json as already read.

    A compacted shard is read a row group (or a block of lines) at a time; a shard still in parts
    (run directories of earlier versions) is merged from its parts a window at a time."""
    folder = run.shard_folder(shard.index)
    if done is UNREAD:
        done = folder.done_record()
    compacted = folder.compacted(done)
    lines = run.output_format == "jsonl"
    if compacted is None:
        yield from _parts_in_order(run, shard, folder.committed_files(done), lines)
        return
    if not compacted.is_file():
        folder.check_compacted(compacted)  # raises, naming the file and what to do
    pieces = _jsonl_blocks(run, compacted, lines) if compacted.suffix == ".jsonl" else _row_groups(run, compacted)
    expected = shard.start
    dropped = 0
    for piece in pieces:
        rows = piece.table.column("row").to_numpy()
        keep = keep_mask_sorted(rows, expected - 1)
        if not keep.all():  # sealed by an earlier version with a row twice
            dropped += int((~keep).sum())
            rows = rows[keep]
            mask = pa.array(keep)
            piece = Rows(piece.table.filter(mask), take_lines(piece.lines, keep) if piece.lines is not None else None)
        n = len(rows)
        if n and (rows[0] != expected or expected + n > shard.stop or (n > 1 and (np.diff(rows) != 1).any())):
            _rows_mismatch(run, shard, [compacted])
        expected += n
        if n:
            yield piece
    if expected != shard.stop:
        _rows_mismatch(run, shard, [compacted])
    if dropped:
        log.warning(
            "shard %d: %s holds %d extra copies of rows; each row is merged once (its first copy)",
            shard.index,
            compacted,
            dropped,
        )


def _rows_mismatch(run: RunDir, shard: Shard, files: list[Path]) -> None:
    """Raise, naming what is wrong with the shard's rows (read again: this is the error path)."""
    problem = ShardRows(shard, files, run.schema).check.problem() or "rows out of order"
    raise RunDirError(
        f"shard {shard.index}: committed rows do not match rows {shard.start}..{shard.stop - 1} "
        f"({problem}); the shard folder was changed by hand or by two writers"
    )


def _parts_in_order(run: RunDir, shard: Shard, parts: list[Path], lines: bool) -> Iterator[Rows]:
    """A shard in parts, merged in row order a window at a time, each row once (JSONL to JSONL: the
    lines as committed)."""
    rows = ShardRows(shard, parts, run.schema)
    if not rows.check.complete:
        _rows_mismatch(run, shard, parts)
    if rows.check.dropped:
        log.warning("shard %d: %s; each row is merged once (its first copy)", shard.index, rows.check.duplicates_text())
    columns = stat_columns(run)
    for _, data in rows.windows(group_rows(rows.row_bytes), lines=lines):
        if isinstance(data, bytes):
            yield Rows(jsonl_columns(data, run.schema, columns), data)
        else:
            yield Rows(data)


def _row_groups(run: RunDir, path: Path) -> Iterator[Rows]:
    """A compacted Parquet file, one row group at a time."""
    with pq.ParquetFile(path) as f:
        for i in range(f.num_row_groups):
            table = f.read_row_group(i)
            yield Rows(table if table.schema.equals(run.schema) else table.cast(run.schema))


def _jsonl_blocks(run: RunDir, path: Path, lines: bool) -> Iterator[Rows]:
    """A compacted JSONL file in blocks of whole lines: the lines themselves for a JSONL output."""
    columns = stat_columns(run)
    for data in line_blocks(path, READ_BLOCK_BYTES):
        yield Rows(jsonl_columns(data, run.schema, columns), data) if lines else Rows(jsonl_to_table(data, run.schema))
