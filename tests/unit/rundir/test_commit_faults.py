"""Faults around a commit, stop signals in awkward places and rows vLLM refuses: every row still
lands in the output exactly once, and nothing committed is rewritten (issue 13)."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import pytest
from support.fake_engine import FakeEngine, prepared

from batchinfer.engine.vllm_engine import Completion
from batchinfer.engine.worker import ShardWorker, StopFlag
from batchinfer.errors import RunDirError
from batchinfer.inputs.read import Shard
from batchinfer.rundir import store
from batchinfer.rundir.locks import ShardLock
from batchinfer.rundir.schema import error_row, rows_to_table
from batchinfer.rundir.store import RunDir

# ---------------------------------------------------------------- publishing a part (no engine)


def test_a_part_name_taken_meanwhile_is_never_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = prepared(tmp_path, 4)
    run.shard_dir(0).mkdir(parents=True)
    first = run.write_part(0, rows_to_table([error_row(0, "doc-00000", "x", "first")], run.schema))
    before = first.read_bytes()
    # A listing that misses part 0 (a second writer, or NFS's attribute cache) must not overwrite it.
    monkeypatch.setattr(RunDir, "parts", lambda self, index: [])
    second = run.write_part(0, rows_to_table([error_row(1, "doc-00001", "x", "second")], run.schema))
    monkeypatch.undo()
    assert (first.name, second.name) == ("part-000000.parquet", "part-000001.parquet")
    assert first.read_bytes() == before
    assert run.read_shard(0).column("row").to_pylist() == [0, 1]


def test_a_link_that_answers_eexist_after_succeeding_publishes_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = prepared(tmp_path, 4)
    run.shard_dir(0).mkdir(parents=True)
    real_link = os.link

    def retransmitted(src: Any, dst: Any) -> None:  # NFS: the LINK's reply was lost, the retry says EEXIST
        real_link(src, dst)
        raise FileExistsError(errno.EEXIST, "File exists", str(dst))

    monkeypatch.setattr(store.os, "link", retransmitted)
    part = run.write_part(0, rows_to_table([error_row(0, "doc-00000", "x", "m")], run.schema))
    monkeypatch.undo()
    assert part.name == "part-000000.parquet"
    assert sorted(os.listdir(run.shard_dir(0))) == ["part-000000.parquet"]  # no second copy, no temporary


# ---------------------------------------------------------------- failure budget (fake engine)


class FailingEngine(FakeEngine):
    def step(self) -> list[Completion]:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_failures_are_counted_under_the_lock_per_submission(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = prepared(tmp_path, 6)
    shard = Shard(0, 0, 6)
    worker = ShardWorker(run, FailingEngine, StopFlag())
    real_write = worker._write_progress
    held = []

    def write_progress(*args: Any, **kw: Any) -> None:
        try:  # a second writer is refused: the count is written under the shard lock
            with ShardLock(run.shard_dir(0)):
                held.append(False)
        except RunDirError:
            held.append(True)
        real_write(*args, **kw)

    monkeypatch.setattr(worker, "_write_progress", write_progress)
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "100")
    for _ in range(2):
        with pytest.raises(RuntimeError):
            worker.run_shard(shard)
    assert worker.failures == 2
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "200")  # `resume` is a new submission: a new budget
    with pytest.raises(RuntimeError):
        worker.run_shard(shard)
    assert worker.failures == 1
    progress = json.loads(run.progress_path(0).read_text())
    assert progress["failures"] == 3 and progress["failures_by_job"] == {"100": 2, "200": 1}
    assert "illegal memory access" in progress["last_error"]
    assert held and all(held)
