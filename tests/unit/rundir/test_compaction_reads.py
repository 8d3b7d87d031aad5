"""Sealing a shard of Parquet parts reads each part once, however many windows the shard takes
(issue 27, item 13): parts are single row groups, so reading them a window at a time re-read every
part for every window. Counted as opens of each part file, not timed."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from support.parts import committed, finish_all, output_row

from batchinfer.rundir import tables
from batchinfer.rundir.schema import rows_to_table

ROWS, PART_ROWS = 120, 10


def test_sealing_reads_each_parquet_part_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = committed(tmp_path, "run", "parquet", 1, ROWS)
    folder = run.shard_dir(0)
    for p in run.shard_folder(0).part_files():  # committed() writes unsorted parts; a worker sorts its parts
        p.unlink()
    order = list(range(ROWS))
    random.Random(0).shuffle(order)  # work order: each part's rows spread over the whole shard
    for start in range(0, ROWS, PART_ROWS):
        rows = sorted(order[start : start + PART_ROWS])
        run.shard_folder(0).write_part(rows_to_table([output_row(run, r) for r in rows], run.schema))
    parts = [p.name for p in run.shard_folder(0).part_files()]
    monkeypatch.setattr(tables, "GROUP_BYTES", 1)  # windows of MIN_GROUP_ROWS rows: 8 windows
    monkeypatch.setattr(tables, "MIN_GROUP_ROWS", 16)

    opened: Counter[str] = Counter()
    real = pq.ParquetFile

    class Counting(real):  # type: ignore[misc, valid-type]
        def __init__(self, source: Any, *args: Any, **kwargs: Any) -> None:
            opened[Path(source).name] += 1
            super().__init__(source, *args, **kwargs)

    def no_read_table(source: Any, *args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"{source} read around the counter")

    monkeypatch.setattr(pq, "ParquetFile", Counting)
    monkeypatch.setattr(pq, "read_table", no_read_table)
    finish_all(run)
    monkeypatch.undo()

    # each part: its row column once (checking the range), its rows once (merging)
    assert {name: opened[name] for name in parts} == {name: 2 for name in parts}
    sealed = pq.ParquetFile(folder / "rows.parquet")
    assert sealed.num_row_groups == ROWS // 16 + 1  # the shard did take several windows
    table = sealed.read()
    assert table.column("row").to_pylist() == list(range(ROWS))
    assert table.to_pylist() == [output_row(run, r) for r in range(ROWS)]
    assert not [p.name for p in folder.iterdir() if p.name.startswith((".tmp-", "part-"))]  # no scratch file left
