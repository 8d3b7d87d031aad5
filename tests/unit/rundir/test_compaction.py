"""A finished shard's parts compacted into one file named by DONE.json: a kill at every step of it,
then resume, status and merge see every row exactly once, byte for byte as without the kill, and
the leftovers are gone (issue 16). No engine: parts are written as a worker commits them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from support.parts import DONE, ROWS, committed, finish_all, output_row

from batchinfer.errors import RunDirError
from batchinfer.insight.status import shard_status
from batchinfer.rundir import merge as merge_mod
from batchinfer.rundir import store
from batchinfer.rundir.locks import ShardLock
from batchinfer.rundir.merge import merge, shard_rows_in_order
from batchinfer.rundir.schema import rows_to_table
from batchinfer.rundir.stats import shard_stats
from batchinfer.rundir.store import RunDir, read_json, write_json

# What a worker does to finish a shard: under the shard's lock, RunDir.finish_shard.
FINISH = """
import json, sys
from batchinfer.rundir.locks import ShardLock
from batchinfer.rundir.store import RunDir
run = RunDir(sys.argv[1])
with ShardLock(run.shard_dir(int(sys.argv[2]))):
    run.finish_shard(int(sys.argv[2]), json.loads(sys.argv[3]))
"""


def resume(run: RunDir) -> None:
    """What a resumed worker does per shard (ShardWorker._finish): under the lock, a killed writer's
    leftovers go; a finished shard is then left as it is, the others are finished from their parts."""
    for shard in run.shards():
        with ShardLock(run.shard_dir(shard.index), log=lambda m: None):
            run.clean_temporaries(shard.index)
            if run.is_done(shard.index):
                continue
            rows = run.read_shard(shard.index, columns=["row"]).column("row").to_pylist()
            assert sorted(rows) == list(range(shard.start, shard.stop))  # every row once: nothing to redo
            run.finish_shard(shard.index, DONE)


def listing(run: RunDir, index: int) -> list[str]:
    return sorted(os.listdir(run.shard_dir(index)))


def merged_bytes(run: RunDir) -> bytes:
    merge(run)
    return run.output_path.read_bytes()


@pytest.fixture(params=["parquet", "jsonl"])
def fmt(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def reference(tmp_path: Path, fmt: str) -> dict[str, Any]:
    """The uninterrupted run: its compacted files and merged output."""
    run = committed(tmp_path, "reference", fmt)
    finish_all(run)
    files = {s.index: run.compacted(s.index).read_bytes() for s in run.shards()}  # type: ignore[union-attr]
    return {"run": run, "compacted": files, "output": merged_bytes(run)}


def test_compaction_writes_one_sorted_file_named_by_done(tmp_path: Path, fmt: str) -> None:
    run = committed(tmp_path, "run", fmt)
    commit_order = run.read_shard(0).column("row").to_pylist()
    assert commit_order != sorted(commit_order) and len(run.parts(0)) == 3
    finish_all(run)
    name = f"rows.{fmt}"
    assert read_json(run.done_path(0)) == dict(DONE, compacted=name)
    assert listing(run, 0) == ["DONE.json", "lock", "progress.json", name]
    assert run.parts(0) == [run.shard_dir(0) / name]
    table = run.read_shard(0)
    assert table.column("row").to_pylist() == list(range(12))  # sorted by row
    assert table.to_pylist() == rows_to_table([output_row(run, r) for r in range(12)], run.schema).to_pylist()
    if fmt == "parquet":
        assert pq.read_schema(run.shard_dir(0) / name).equals(run.schema)


@pytest.mark.parametrize(
    "fault",
    ["in-compact-write", "before-compact-rename", "after-compact-rename", "after-compact-done", "in-compact-cleanup"],
)
def test_a_kill_at_every_step_of_compaction(
    tmp_path: Path, fmt: str, reference: dict[str, Any], fault: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = committed(tmp_path, "killed", fmt)
    parts = [p.name for p in run.parts(0)]
    rows_before = run.read_shard(0).to_pylist()
    res = subprocess.run(
        [sys.executable, "-c", FINISH, str(run.path), "0", json.dumps(DONE)],
        env={**os.environ, "BATCHINFER_FAULT": fault},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == -signal.SIGKILL, res.stderr[-2000:]
    # The kill landed where the point claims: what is on disk is that step's state, no other.
    name, files = f"rows.{fmt}", listing(run, 0)
    temporaries = [f for f in files if f.startswith(f".tmp-{name}.")]
    done = run.done_record(0)
    if fault in ("in-compact-write", "before-compact-rename"):
        assert len(temporaries) == 1 and name not in files and done is None
        whole = (run.shard_dir(0) / temporaries[0]).read_bytes() == reference["compacted"][0]
        assert whole == (fault == "before-compact-rename")  # half written, or complete and fsynced
    elif fault == "after-compact-rename":
        assert not temporaries and done is None
        assert (run.shard_dir(0) / name).read_bytes() == reference["compacted"][0]  # published, not yet named
    else:
        assert done == dict(DONE, compacted=name)
    left = [f for f in files if f.startswith("part-")]
    assert left == (parts[1:] if fault == "in-compact-cleanup" else parts)

    # Readers follow the rule before anything is cleaned: every row once, in the truth's file(s).
    assert sorted(r["row"] for r in run.read_shard(0).to_pylist()) == list(range(12))
    if done is None:
        assert run.read_shard(0).to_pylist() == rows_before  # the parts, the compacted leftover ignored
    state = {r["shard"]: (r["state"], r["rows_done"]) for r in shard_status(run, {})}
    assert state[0] == (("partial", 12) if done is None else ("done", 12)) and state[1] == ("partial", 12)
    assert [s["done"] for s in shard_stats(run)] == [done is not None, False]

    resume(run)
    if done is not None:  # finished: the resumed worker removed only the parts DONE.json replaced
        assert listing(run, 0) == ["DONE.json", "lock", "progress.json", name]
    assert merged_bytes(run) == reference["output"]
    stats, ref_stats = read_json(run.stats_json), read_json(reference["run"].stats_json)
    assert {k: v for k, v in stats.items() if k != "merge_seconds"} == {
        k: v for k, v in ref_stats.items() if k != "merge_seconds"
    }
    for shard in run.shards():
        assert listing(run, shard.index) == ["DONE.json", "lock", "progress.json", name]  # leftovers removed
        assert run.compacted(shard.index).read_bytes() == reference["compacted"][shard.index]  # type: ignore[union-attr]


def test_parts_of_a_compacted_shard_are_ignored_and_removed_by_merge(
    tmp_path: Path, fmt: str, reference: dict[str, Any]
) -> None:
    run = committed(tmp_path, "run", fmt)
    finish_all(run)
    # A killed cleanup's parts, and one that would duplicate rows if it were read.
    run.shard_dir(1).joinpath(f"part-000000.{fmt}").write_bytes(
        store.table_bytes(rows_to_table([output_row(run, 12)], run.schema), fmt)
    )
    assert run.read_shard(1).column("row").to_pylist() == list(range(12, 24))
    assert merged_bytes(run) == reference["output"]
    assert not list(run.shard_dir(1).glob("part-*"))


def test_a_run_dir_of_an_earlier_version_merges_from_its_parts(
    tmp_path: Path, fmt: str, reference: dict[str, Any]
) -> None:
    """DONE.json names no compacted file: the parts are the truth; a rows.* file is a leftover."""
    run = committed(tmp_path, "old", fmt)
    for shard in run.shards():
        write_json(run.done_path(shard.index), DONE)
    stray = run.shard_dir(0) / f"rows.{fmt}"
    stray.write_bytes(reference["compacted"][1])  # wrong rows: read, it would break the merge
    assert [p.name for p in run.parts(0)] == [f"part-00000{i}.{fmt}" for i in range(3)]
    assert merged_bytes(run) == reference["output"]
    assert not stray.exists() and len(run.parts(0)) == 3
    assert read_json(run.stats_json)["rows"] == ROWS


def test_a_leftover_compacted_file_is_removed_under_the_shard_lock(tmp_path: Path, fmt: str) -> None:
    run = committed(tmp_path, "run", fmt)
    stray = run.shard_dir(0) / f"rows.{fmt}"
    stray.write_bytes(b"a killed compaction's file")
    (run.shard_dir(0) / f".tmp-rows.{fmt}.1-abc").write_bytes(b"half")
    assert run.clean_temporaries(0) == 2 and not stray.exists()
    assert len(run.parts(0)) == 3


def test_done_naming_a_path_outside_the_shard_is_refused(tmp_path: Path) -> None:
    run = committed(tmp_path, "run", "parquet")
    write_json(run.done_path(0), dict(DONE, compacted="../../run.yaml"))
    with pytest.raises(RunDirError, match=r"'compacted' is '\.\./\.\./run\.yaml'"):
        run.parts(0)


def test_merge_streams_a_compacted_shard_in_row_groups_and_blocks(
    tmp_path: Path, fmt: str, reference: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Row groups of 5 rows (Parquet) and blocks of 100 bytes (JSONL, lines cut across blocks):
    the shard comes in many pieces, in order, and the output is the same bytes."""
    monkeypatch.setattr(store, "ROW_GROUP_ROWS", 5)
    monkeypatch.setattr(merge_mod, "READ_BLOCK_BYTES", 100)
    run = committed(tmp_path, "run", fmt)
    finish_all(run)
    shard = run.shards()[1]
    pieces = list(shard_rows_in_order(run, shard))
    assert len(pieces) >= 3
    assert [r for p in pieces for r in p.table.column("row").to_pylist()] == list(range(12, 24))
    if fmt == "parquet":
        assert pq.ParquetFile(run.compacted(1)).num_row_groups == 3  # type: ignore[arg-type]
        merge(run)  # the output's row groups follow the pieces: the same rows, not the same bytes
        assert pq.read_table(run.output_path).equals(pq.read_table(reference["run"].output_path))
    else:
        assert all(p.lines is not None and p.lines.count(b"\n") == p.table.num_rows for p in pieces)
        assert merged_bytes(run) == reference["output"]


def test_a_compacted_shard_with_a_row_out_of_sequence_is_refused(tmp_path: Path, fmt: str) -> None:
    run = committed(tmp_path, "run", fmt)
    run.write_part(1, rows_to_table([output_row(run, 13)], run.schema))  # two writers: row 13 twice
    finish_all(run)
    with pytest.raises(RunDirError, match=r"shard 1: committed rows do not match rows 12\.\.23 \(duplicates \[13\]"):
        merge(run)
    assert not run.output_path.exists()


def test_the_worker_removes_parts_a_finished_shard_left_without_an_engine(tmp_path: Path, fmt: str) -> None:
    from batchinfer.engine.worker import ShardWorker, StopFlag

    run = committed(tmp_path, "run", fmt)
    parts = {p.name: p.read_bytes() for p in run.parts(0)}
    run.finish_shard(0, DONE)
    compacted = run.compacted(0).read_bytes()  # type: ignore[union-attr]
    for name, data in parts.items():  # as a kill during the parts' removal leaves them
        (run.shard_dir(0) / name).write_bytes(data)
    worker = ShardWorker(run, lambda: pytest.fail("a finished shard needs no engine"), StopFlag())
    assert worker.run_shard(run.shards()[0]) == dict(DONE, compacted=f"rows.{fmt}")
    assert sorted(os.listdir(run.shard_dir(0))) == ["DONE.json", "lock", "progress.json", f"rows.{fmt}"]
    assert run.compacted(0).read_bytes() == compacted  # type: ignore[union-attr]
