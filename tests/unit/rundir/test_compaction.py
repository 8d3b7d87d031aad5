"""A finished shard's parts compacted into one file named by DONE.json: a kill at every step of it,
then resume, status and merge see every row exactly once, byte for byte as without the kill, and
the leftovers are gone (issue 16). No engine: parts are written as a worker commits them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import pyarrow.parquet as pq
import pytest
from support.parts import DONE, ROWS, committed, finish_all, output_row

from batchinfer.durable import read_json, write_json
from batchinfer.errors import RunDirError
from batchinfer.insight.status import shard_status
from batchinfer.rundir import ordered_rows, tables
from batchinfer.rundir.merge import merge
from batchinfer.rundir.ordered_rows import shard_rows_in_order
from batchinfer.rundir.schema import rows_to_table
from batchinfer.rundir.stats import shard_stats
from batchinfer.rundir.store import RunDir

# What a worker does to finish a shard whose rows are all committed: the real ShardWorker, which
# under the shard's lock removes a killed writer's leftovers, reads the parts and seals the shard
# (no engine: nothing is left to generate).
FINISH = """
import sys
from batchinfer.engine.stopflag import StopFlag
from batchinfer.engine.worker import ShardWorker
from batchinfer.rundir.store import RunDir

def no_engine():
    raise SystemExit("a shard whose rows are all committed needs no engine")

run = RunDir(sys.argv[1])
ShardWorker(run, no_engine, StopFlag()).run_shard(run.shards()[int(sys.argv[2])])
"""


def no_engine() -> Any:
    pytest.fail("a shard whose rows are all committed needs no engine")


def resume(run: RunDir) -> None:
    """What a resumed task does: the real worker over every shard, without an engine (every row is
    committed, so none is needed; a worker that asked for one fails the test)."""
    from batchinfer.engine.stopflag import StopFlag
    from batchinfer.engine.worker import ShardWorker

    worker = ShardWorker(run, no_engine, StopFlag())
    for shard in run.shards():
        worker.run_shard(shard)


def sealed(record: Optional[dict[str, Any]], fmt: str) -> bool:
    """Whether a DONE record is the worker's seal of a 12-row shard naming its compacted file."""
    return record is not None and record["compacted"] == f"rows.{fmt}" and record["rows_done"] == 12


def without_seconds(stats: dict[str, Any]) -> dict[str, Any]:
    """stats.json without what depends on who sealed the shards and when (phase and merge seconds)."""
    return {k: v for k, v in stats.items() if k not in ("merge_seconds", "seconds")}


def listing(run: RunDir, index: int) -> list[str]:
    return sorted(os.listdir(run.shard_dir(index)))


def merged_bytes(run: RunDir) -> bytes:
    merge(run)
    return run.output_path.read_bytes()


def test_compaction_writes_one_sorted_file_named_by_done(tmp_path: Path, fmt: str) -> None:
    run = committed(tmp_path, "run", fmt)
    commit_order = run.shard_folder(0).read_rows().column("row").to_pylist()
    assert commit_order != sorted(commit_order) and len(run.shard_folder(0).committed_files()) == 3
    finish_all(run)
    name = f"rows.{fmt}"
    assert read_json(run.shard_folder(0).done_path) == dict(DONE, compacted=name)
    assert listing(run, 0) == ["DONE.json", "lock", "progress.json", name]
    assert run.shard_folder(0).committed_files() == [run.shard_dir(0) / name]
    table = run.shard_folder(0).read_rows()
    assert table.column("row").to_pylist() == list(range(12))  # sorted by row
    assert table.to_pylist() == rows_to_table([output_row(run, r) for r in range(12)], run.schema).to_pylist()
    if fmt == "parquet":
        assert pq.read_schema(run.shard_dir(0) / name).equals(run.schema)


@pytest.mark.parametrize(
    "fault",
    [
        "before-done",
        "in-compact-write",
        "before-compact-rename",
        "after-compact-rename",
        "after-compact-done",
        "in-compact-cleanup",
    ],
)
def test_a_kill_at_every_step_of_compaction(tmp_path: Path, fmt: str, reference: dict[str, Any], fault: str) -> None:
    """The real worker seals shard 0 and is SIGKILLed at each step; the real worker resumed finishes
    the run without an engine, and the output is the uninterrupted run's."""
    run = committed(tmp_path, "killed", fmt)
    parts = [p.name for p in run.shard_folder(0).committed_files()]
    rows_before = run.shard_folder(0).read_rows().to_pylist()
    res = subprocess.run(
        [sys.executable, "-c", FINISH, str(run.path), "0"],
        env={**os.environ, "BATCHINFER_FAULT": fault},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == -signal.SIGKILL, res.stderr[-2000:]
    # The kill landed where the point claims: what is on disk is that step's state, no other.
    name, files = f"rows.{fmt}", listing(run, 0)
    temporaries = [f for f in files if f.startswith(f".tmp-{name}.")]
    done = run.shard_folder(0).done_record()
    if fault == "before-done":
        assert not temporaries and name not in files and done is None
    elif fault in ("in-compact-write", "before-compact-rename"):
        assert len(temporaries) == 1 and name not in files and done is None
        whole = (run.shard_dir(0) / temporaries[0]).read_bytes() == reference["compacted"][0]
        assert whole == (fault == "before-compact-rename")  # half written, or complete and fsynced
    elif fault == "after-compact-rename":
        assert not temporaries and done is None
        assert (run.shard_dir(0) / name).read_bytes() == reference["compacted"][0]  # published, not yet named
    else:
        assert sealed(done, fmt)
    left = [f for f in files if f.startswith("part-")]
    assert left == (parts[1:] if fault == "in-compact-cleanup" else parts)

    # Readers follow the rule before anything is cleaned: every row once, in the truth's file(s).
    assert sorted(r["row"] for r in run.shard_folder(0).read_rows().to_pylist()) == list(range(12))
    if done is None:
        assert run.shard_folder(0).read_rows().to_pylist() == rows_before  # the parts, the compacted leftover ignored
    state = {r["shard"]: (r["state"], r["rows_done"]) for r in shard_status(run, {})}
    assert state[0] == (("partial", 12) if done is None else ("done", 12)) and state[1] == ("partial", 12)
    assert [s["done"] for s in shard_stats(run)] == [done is not None, False]

    resume(run)
    if done is not None:  # finished: the resumed worker removed only the parts DONE.json replaced
        assert listing(run, 0) == ["DONE.json", "lock", "progress.json", name]
        assert run.shard_folder(0).done_record() == done  # and kept the seal as it was
    assert merged_bytes(run) == reference["output"]
    stats, ref_stats = read_json(run.stats_json), read_json(reference["run"].stats_json)
    assert without_seconds(stats) == without_seconds(ref_stats)
    for shard in run.shards():
        assert listing(run, shard.index) == ["DONE.json", "lock", "progress.json", name]  # leftovers removed
        assert sealed(run.shard_folder(shard.index).done_record(), fmt)
        assert run.shard_folder(shard.index).compacted().read_bytes() == reference["compacted"][shard.index]  # type: ignore[union-attr]


def test_parts_of_a_compacted_shard_are_ignored_and_removed_by_merge(
    tmp_path: Path, fmt: str, reference: dict[str, Any]
) -> None:
    run = committed(tmp_path, "run", fmt)
    finish_all(run)
    # A killed cleanup's parts, and one that would duplicate rows if it were read.
    run.shard_dir(1).joinpath(f"part-000000.{fmt}").write_bytes(
        tables.table_bytes(rows_to_table([output_row(run, 12)], run.schema), fmt)
    )
    assert run.shard_folder(1).read_rows().column("row").to_pylist() == list(range(12, 24))
    assert merged_bytes(run) == reference["output"]
    assert not list(run.shard_dir(1).glob("part-*"))


def test_a_run_dir_of_an_earlier_version_merges_from_its_parts(
    tmp_path: Path, fmt: str, reference: dict[str, Any]
) -> None:
    """DONE.json names no compacted file: the parts are the truth; a rows.* file is a leftover."""
    run = committed(tmp_path, "old", fmt)
    for shard in run.shards():
        write_json(run.shard_folder(shard.index).done_path, DONE)
    stray = run.shard_dir(0) / f"rows.{fmt}"
    stray.write_bytes(reference["compacted"][1])  # wrong rows: read, it would break the merge
    assert [p.name for p in run.shard_folder(0).committed_files()] == [f"part-00000{i}.{fmt}" for i in range(3)]
    assert merged_bytes(run) == reference["output"]
    assert not stray.exists() and len(run.shard_folder(0).committed_files()) == 3
    assert read_json(run.stats_json)["rows"] == ROWS


def test_a_leftover_compacted_file_is_removed_under_the_shard_lock(tmp_path: Path, fmt: str) -> None:
    run = committed(tmp_path, "run", fmt)
    stray = run.shard_dir(0) / f"rows.{fmt}"
    stray.write_bytes(b"a killed compaction's file")
    (run.shard_dir(0) / f".tmp-rows.{fmt}.1-abc").write_bytes(b"half")
    assert run.shard_folder(0).remove_temporaries_and_leftovers() == 2 and not stray.exists()
    assert len(run.shard_folder(0).committed_files()) == 3


def test_done_naming_a_path_outside_the_shard_is_refused(tmp_path: Path) -> None:
    run = committed(tmp_path, "run", "parquet")
    write_json(run.shard_folder(0).done_path, dict(DONE, compacted="../../run.yaml"))
    with pytest.raises(RunDirError, match=r"'compacted' is '\.\./\.\./run\.yaml'"):
        run.shard_folder(0).committed_files()


def test_merge_streams_a_compacted_shard_in_row_groups_and_blocks(
    tmp_path: Path, fmt: str, reference: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Row groups of 5 rows (Parquet) and blocks of 100 bytes (JSONL, lines cut across blocks):
    the shard comes in many pieces, in order, and the output is the same bytes."""
    monkeypatch.setattr(tables, "ROW_GROUP_ROWS", 5)
    monkeypatch.setattr(ordered_rows, "READ_BLOCK_BYTES", 100)
    run = committed(tmp_path, "run", fmt)
    finish_all(run)
    shard = run.shards()[1]
    pieces = list(shard_rows_in_order(run, shard))
    assert len(pieces) >= 3
    assert [r for p in pieces for r in p.table.column("row").to_pylist()] == list(range(12, 24))
    if fmt == "parquet":
        assert pq.ParquetFile(run.shard_folder(1).compacted()).num_row_groups == 3  # type: ignore[arg-type]
        merge(run)  # the output's row groups follow the pieces: the same rows, not the same bytes
        assert pq.read_table(run.output_path).equals(pq.read_table(reference["run"].output_path))
    else:
        assert all(p.lines is not None and p.lines.count(b"\n") == p.table.num_rows for p in pieces)
        assert merged_bytes(run) == reference["output"]


def test_a_row_committed_twice_is_sealed_once_keeping_the_first_copy(
    tmp_path: Path, fmt: str, reference: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Two writers: row 13 committed again, with other content, after the shard's own parts. The real
    worker seals the shard with row 13 once, as first committed, logs it, and merge takes it."""
    run = committed(tmp_path, "run", fmt)
    second = dict(output_row(run, 13), text="a second writer's copy")
    run.shard_folder(1).write_part(rows_to_table([second], run.schema))
    assert run.shard_folder(1).read_rows().column("row").to_pylist().count(13) == 2  # the fault is in place
    resume(run)
    done = run.shard_folder(1).done_record()
    assert sealed(done, fmt) and done["duplicates_dropped"] == 1  # type: ignore[index]
    table = run.shard_folder(1).read_rows()
    assert table.column("row").to_pylist() == list(range(12, 24))
    assert table.to_pylist()[1] == rows_to_table([output_row(run, 13)], run.schema).to_pylist()[0]
    assert run.shard_folder(1).compacted().read_bytes() == reference["compacted"][1]  # type: ignore[union-attr]
    assert "shard 1: 1 extra copies of rows 13" in caplog.text
    assert merged_bytes(run) == reference["output"]


def test_the_worker_removes_parts_a_finished_shard_left_without_an_engine(tmp_path: Path, fmt: str) -> None:
    from batchinfer.engine.stopflag import StopFlag
    from batchinfer.engine.worker import ShardWorker

    run = committed(tmp_path, "run", fmt)
    parts = {p.name: p.read_bytes() for p in run.shard_folder(0).committed_files()}
    run.shard_folder(0).finish(DONE)
    compacted = run.shard_folder(0).compacted().read_bytes()  # type: ignore[union-attr]
    for name, data in parts.items():  # as a kill during the parts' removal leaves them
        (run.shard_dir(0) / name).write_bytes(data)
    worker = ShardWorker(run, no_engine, StopFlag())
    assert worker.run_shard(run.shards()[0]) == dict(DONE, compacted=f"rows.{fmt}")
    assert sorted(os.listdir(run.shard_dir(0))) == ["DONE.json", "lock", "progress.json", f"rows.{fmt}"]
    assert run.shard_folder(0).compacted().read_bytes() == compacted  # type: ignore[union-attr]
