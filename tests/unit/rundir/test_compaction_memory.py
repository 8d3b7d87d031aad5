"""Sealing a shard merges its sorted parts a row group at a time: its memory is bounded by the group,
not by the shard (issue 27, item 13). Measured in a child process as Arrow's peak allocation
(Parquet) and Python's (tracemalloc, JSONL): byte counts of the data, not timings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from support.runs import fake_model_dir

from batchinfer.config.compose import compose
from batchinfer.rundir.prepare import prepare
from batchinfer.rundir.store import RunDir

ROWS, PART_ROWS, TEXT = 20_000, 500, 1000

SEAL = """
import json, sys, tracemalloc
import pyarrow as pa
from batchinfer.rundir import tables
from batchinfer.rundir.store import RunDir

tables.GROUP_BYTES, tables.MIN_GROUP_ROWS = 256 << 10, 64  # groups of ~256 rows of ~1 KB
run = RunDir(sys.argv[1])
run.shard_folder(0).read_rows(columns=["row"])  # config, schema and readers loaded before measuring: not data
tracemalloc.start()
run.shard_folder(0).finish({"rows_done": run.shards()[0].rows})
print(json.dumps({"arrow": pa.default_memory_pool().max_memory(), "python": tracemalloc.get_traced_memory()[1]}))
"""


def build(tmp_path: Path, fmt: str) -> RunDir:
    """One shard of ROWS rows of ~TEXT characters, committed as a worker commits: parts of PART_ROWS
    rows sorted by row, each part's rows spread over the whole shard (work order)."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"d{i}", "text": "x"}) + "\n" for i in range(ROWS)))
    run = prepare(
        compose(
            [
                f"input.path={corpus}",
                "input.id_column=id",
                f"model.path={fake_model_dir(tmp_path)}",
                f"output.dir={tmp_path / 'run'}",
                f"output.format={fmt}",
                "sharding.num_shards=1",
            ]
        )
    )
    rng = np.random.default_rng(0)
    order = rng.permutation(ROWS)
    run.shard_dir(0).mkdir(parents=True)
    for start in range(0, ROWS, PART_ROWS):
        r = np.sort(order[start : start + PART_ROWS])
        table = pa.table(
            {
                "row": pa.array(r, pa.int64()),
                "id": pa.array([f"d{x}" for x in r.tolist()]),
                "text": pa.array([f"{x:08d}" + "é" * (TEXT // 2 - 4) for x in r.tolist()]),
                "finish_reason": pa.array(["stop"] * len(r)),
                "prompt_tokens": pa.array(r % 50, pa.int32()),
                "output_tokens": pa.array(r % 30, pa.int32()),
                "error": pa.nulls(len(r), run.schema.field("error").type),
                "request_digest": pa.array([f"{x:032x}" for x in r.tolist()]),
                "reused": pa.array([False] * len(r)),
            },
            schema=run.schema,
        )
        run.shard_folder(0).write_part(table)
    return run


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_sealing_a_shard_holds_a_row_group_not_the_shard(tmp_path: Path, fmt: str) -> None:
    run = build(tmp_path, fmt)
    shard_bytes = ROWS * TEXT  # the texts alone, in memory
    res = subprocess.run(
        [sys.executable, "-c", SEAL, str(run.path)], capture_output=True, text=True, timeout=300, check=False
    )
    assert res.returncode == 0, res.stderr[-2000:]
    peak = json.loads(res.stdout.splitlines()[-1])
    table = run.shard_folder(0).read_rows()
    assert table.column("row").to_pylist() == list(range(ROWS))  # sealed, sorted, each row once
    assert table.column("text")[1234].as_py().startswith("00001234")
    held = peak["arrow"] if fmt == "parquet" else peak["python"]
    # The whole shard sorted in memory is at least shard_bytes (twice, with its sorted copy); a
    # group of ~256 rows is ~0.25 MB, read beside one part (~0.5 MB) at a time.
    assert held < shard_bytes / 4, peak
