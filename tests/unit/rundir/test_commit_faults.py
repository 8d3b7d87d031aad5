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

from batchinfer import durable
from batchinfer.engine.stopflag import StopFlag
from batchinfer.engine.vllm_engine import Completion
from batchinfer.engine.worker import ShardWorker
from batchinfer.errors import RunDirError
from batchinfer.inputs.shards import Shard
from batchinfer.locks import ShardLock
from batchinfer.rundir.schema import error_row, rows_to_table
from batchinfer.rundir.shard_folder import ShardFolder

# ---------------------------------------------------------------- publishing a part (no engine)


def test_a_part_name_taken_meanwhile_is_never_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = prepared(tmp_path, 4)
    run.shard_dir(0).mkdir(parents=True)
    first = run.shard_folder(0).write_part(rows_to_table([error_row(0, "doc-00000", "x", "first")], run.schema))
    before = first.read_bytes()
    # A listing that misses part 0 (a second writer, or NFS's attribute cache) must not overwrite it:
    # write_part lists the folder with part_files, so that is the listing that misses it.
    listed, linked = [], []
    monkeypatch.setattr(ShardFolder, "part_files", lambda self: listed.append(self.index) or [])
    real_link = os.link

    def link(src: Any, dst: Any) -> None:
        linked.append(Path(dst).name)
        real_link(src, dst)

    monkeypatch.setattr(durable.os, "link", link)
    second = run.shard_folder(0).write_part(rows_to_table([error_row(1, "doc-00001", "x", "second")], run.schema))
    monkeypatch.undo()
    # The fault landed: the stale listing was used, the first name tried was taken, the next one won.
    assert listed == [0] and linked == ["part-000000.parquet", "part-000001.parquet"]
    assert (first.name, second.name) == ("part-000000.parquet", "part-000001.parquet")
    assert first.read_bytes() == before
    assert run.shard_folder(0).read_rows().column("row").to_pylist() == [0, 1]
    assert sorted(os.listdir(run.shard_dir(0))) == ["part-000000.parquet", "part-000001.parquet"]


def test_a_link_that_answers_eexist_after_succeeding_publishes_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = prepared(tmp_path, 4)
    run.shard_dir(0).mkdir(parents=True)
    real_link = os.link

    def retransmitted(src: Any, dst: Any) -> None:  # NFS: the LINK's reply was lost, the retry says EEXIST
        real_link(src, dst)
        raise FileExistsError(errno.EEXIST, "File exists", str(dst))

    monkeypatch.setattr(durable.os, "link", retransmitted)
    part = run.shard_folder(0).write_part(rows_to_table([error_row(0, "doc-00000", "x", "m")], run.schema))
    monkeypatch.undo()
    assert part.name == "part-000000.parquet"
    assert sorted(os.listdir(run.shard_dir(0))) == ["part-000000.parquet"]  # no second copy, no temporary


def test_a_stale_link_count_does_not_publish_the_same_bytes_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NFS: the LINK succeeded, its retransmission answers EEXIST, and the attribute cache still says
    the temporary has one name (st_nlink 1): the part is published once, not again as the next name."""
    run = prepared(tmp_path, 4)
    run.shard_dir(0).mkdir(parents=True)
    real_link, real_stat = os.link, os.stat
    stale, links = [], []

    def retransmitted(src: Any, dst: Any) -> None:  # the first LINK's reply is lost, its retry says EEXIST
        links.append(Path(dst).name)
        real_link(src, dst)
        if len(links) == 1:
            raise FileExistsError(errno.EEXIST, "File exists", str(dst))

    def stat(path: Any, *args: Any, **kw: Any) -> os.stat_result:
        st = real_stat(path, *args, **kw)
        if Path(path).name.startswith(".tmp-"):
            stale.append(st.st_nlink)  # the true count, before the stale cache hides it
            fields = list(st)
            fields[3] = 1  # st_nlink, as a stale attribute cache reports it
            return os.stat_result(fields)
        return st

    monkeypatch.setattr(durable.os, "link", retransmitted)
    monkeypatch.setattr(durable.os, "stat", stat)
    part = run.shard_folder(0).write_part(rows_to_table([error_row(0, "doc-00000", "x", "m")], run.schema))
    monkeypatch.undo()
    assert stale and stale[0] == 2  # the fault landed: two names, a stat that says one
    assert links == ["part-000000.parquet"]  # no second name tried
    assert part.name == "part-000000.parquet"
    assert sorted(os.listdir(run.shard_dir(0))) == ["part-000000.parquet"]
    assert run.shard_folder(0).read_rows().column("row").to_pylist() == [0]


def test_an_unlink_that_answers_enoent_after_succeeding_still_publishes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NFS: the temporary's REMOVE succeeded, its retransmission answers ENOENT: the part is published
    and write_part says so, instead of raising (a published commit reported as failed)."""
    run = prepared(tmp_path, 4)
    run.shard_dir(0).mkdir(parents=True)
    real_unlink = os.unlink
    removed = []

    def retransmitted(path: Any, *args: Any, **kw: Any) -> None:
        real_unlink(path, *args, **kw)
        removed.append(Path(path).name)
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(path))

    monkeypatch.setattr(durable.os, "unlink", retransmitted)
    part = run.shard_folder(0).write_part(rows_to_table([error_row(0, "doc-00000", "x", "m")], run.schema))
    created = durable.create_once(run.shard_dir(0) / "marker.json", b"{}")
    monkeypatch.undo()
    assert len(removed) == 2 and all(n.startswith(".tmp-") for n in removed)  # the fault landed twice
    assert part.name == "part-000000.parquet" and created
    assert sorted(os.listdir(run.shard_dir(0))) == ["marker.json", "part-000000.parquet"]
    assert run.shard_folder(0).read_rows().column("row").to_pylist() == [0]


# ---------------------------------------------------------------- failure budget (fake engine)


class FailingEngine(FakeEngine):
    def step(self) -> list[Completion]:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_failures_are_counted_under_the_lock_per_submission(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = prepared(tmp_path, 6)
    shard = Shard(0, 0, 6)
    worker = ShardWorker(run, FailingEngine, StopFlag())
    real_write = worker.write_progress
    held = []

    def write_progress(*args: Any, **kw: Any) -> None:
        try:  # a second writer is refused: the count is written under the shard lock
            with ShardLock(run.shard_dir(0), mode=run.config.output.lock):
                held.append(False)
        except RunDirError:
            held.append(True)
        real_write(*args, **kw)

    monkeypatch.setattr(worker, "write_progress", write_progress)
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "100")
    for _ in range(2):
        with pytest.raises(RuntimeError):
            worker.run_shard(shard)
    assert worker.failures == 2
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "200")  # `resume` is a new submission: a new budget
    with pytest.raises(RuntimeError):
        worker.run_shard(shard)
    assert worker.failures == 1
    progress = json.loads(run.shard_folder(0).progress_path.read_text())
    assert progress["failures"] == 3 and progress["failures_by_job"] == {"100": 2, "200": 1}
    assert "illegal memory access" in progress["last_error"]
    assert held and all(held)
