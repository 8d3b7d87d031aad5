"""A shard is sealed (compacted, DONE.json) only when its committed rows are exactly its range, each
once; a hand-deleted or misread DONE.json never makes a worker delete the compacted file, and parts
go only once the compacted file is there with every row (issue 27, items 1 and 14). No engine: the
real worker finishes shards whose rows are all committed; parts are written as a worker commits."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from support.parts import DONE, committed, finish_all, output_row

from batchinfer.durable import read_json, write_json
from batchinfer.engine.stopflag import StopFlag
from batchinfer.engine.worker import ShardWorker
from batchinfer.errors import RunDirError
from batchinfer.rundir import shard_folder
from batchinfer.rundir.merge import merge
from batchinfer.rundir.schema import rows_to_table
from batchinfer.rundir.store import RunDir
from batchinfer.rundir.tables import read_table, table_bytes


def no_engine() -> Any:
    pytest.fail("a shard whose rows are all committed needs no engine")


def work(run: RunDir, index: int) -> dict[str, Any]:
    """What a (resumed) task does for one shard: the real worker, under the shard's lock."""
    return ShardWorker(run, no_engine, StopFlag()).run_shard(run.shards()[index])


def listing(run: RunDir, index: int) -> list[str]:
    return sorted(os.listdir(run.shard_dir(index)))


# ---------------------------------------------------------------- item 1: checked before sealing


def test_a_shard_with_a_missing_row_is_not_sealed(tmp_path: Path, fmt: str) -> None:
    run = committed(tmp_path, "run", fmt)
    first = run.shard_folder(1).part_files()[0]
    lost = sorted(run.shard_folder(1).read_rows().column("row").to_pylist()[:5])
    first.unlink()  # five rows no longer committed
    before = listing(run, 1)
    with pytest.raises(RunDirError, match=rf"shard 1 not sealed: .*\(5 rows missing \({', '.join(map(str, lost))}\)"):
        run.shard_folder(1).finish(DONE)
    assert listing(run, 1) == before and run.shard_folder(1).done_record() is None  # nothing written, nothing removed


def test_a_part_holding_another_shards_rows_is_not_sealed(tmp_path: Path) -> None:
    run = committed(tmp_path, "run", "parquet")
    run.shard_folder(1).write_part(rows_to_table([output_row(run, 3)], run.schema))  # shard 0's row 3 in shard 1
    with pytest.raises(RunDirError, match=r"part-000003\.parquet holds rows outside the shard \(3\)"):
        work(run, 1)
    assert run.shard_folder(1).done_record() is None and not (run.shard_dir(1) / "rows.parquet").exists()
    assert len(run.shard_folder(1).part_files()) == 4


def test_a_worker_seals_a_shard_with_a_row_twice_once_without_an_engine(
    tmp_path: Path, fmt: str, reference: dict[str, Any]
) -> None:
    """A part published twice (same bytes under two names): the worker needs no engine, seals the
    shard with each row once and removes both copies' parts."""
    run = committed(tmp_path, "run", fmt)
    last = run.shard_folder(0).part_files()[-1]
    twice = rows_in(last, run)
    (run.shard_dir(0) / f"part-000003.{fmt}").write_bytes(last.read_bytes())
    assert len(run.shard_folder(0).read_rows()) == 12 + twice  # the fault is in place
    done = work(run, 0)
    assert done["duplicates_dropped"] == twice == 2
    assert read_json(run.shard_folder(0).done_path) == done
    assert run.shard_folder(0).compacted().read_bytes() == reference["compacted"][0]  # type: ignore[union-attr]
    assert listing(run, 0) == ["DONE.json", "lock", "progress.json", f"rows.{fmt}"]


def rows_in(path: Path, run: RunDir) -> int:
    return read_table(path, run.schema, ["row"]).num_rows


def test_merge_takes_a_shard_sealed_with_a_duplicate_by_an_earlier_version_once(
    tmp_path: Path, fmt: str, reference: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Earlier versions sealed a shard with a row twice; merge drops the later copy as sealing now
    does (instead of refusing the run forever) and says so."""
    run = committed(tmp_path, "run", fmt)
    finish_all(run)
    rows = run.shard_folder(1).read_rows().to_pylist()
    doubled = rows[:2] + [dict(rows[1], text="a second copy")] + rows[2:]
    (run.shard_dir(1) / f"rows.{fmt}").write_bytes(table_bytes(rows_to_table(doubled, run.schema), fmt))
    merge(run)
    assert run.output_path.read_bytes() == reference["output"]
    assert "shard 1: " in caplog.text and "1 extra copies of rows" in caplog.text


def test_merge_refuses_a_sealed_shard_missing_a_row_naming_it(tmp_path: Path, fmt: str) -> None:
    run = committed(tmp_path, "run", fmt)
    finish_all(run)
    rows = [r for r in run.shard_folder(1).read_rows().to_pylist() if r["row"] != 17]
    (run.shard_dir(1) / f"rows.{fmt}").write_bytes(table_bytes(rows_to_table(rows, run.schema), fmt))
    with pytest.raises(
        RunDirError, match=r"shard 1: committed rows do not match rows 12\.\.23 \(1 rows missing \(17\)"
    ):
        merge(run)
    assert not run.output_path.exists()


def test_merge_of_a_shard_sealed_in_parts_drops_a_duplicate_and_refuses_a_gap(
    tmp_path: Path, fmt: str, reference: dict[str, Any]
) -> None:
    """Run directories of earlier versions: DONE.json names no compacted file, the parts are the truth."""
    run = committed(tmp_path, "old", fmt)
    for shard in run.shards():
        write_json(run.shard_folder(shard.index).done_path, DONE)
    run.shard_folder(0).write_part(rows_to_table([dict(output_row(run, 4), text="later")], run.schema))
    merge(run)
    assert run.output_path.read_bytes() == reference["output"]
    run.shard_folder(1).part_files()[0].unlink()
    with pytest.raises(RunDirError, match=r"shard 1: committed rows do not match rows 12\.\.23 \(5 rows missing"):
        merge(run)


# ---------------------------------------------------------------- item 14: the compacted file is never lost


def test_a_hand_deleted_done_json_reseals_from_the_compacted_file(
    tmp_path: Path, fmt: str, reference: dict[str, Any]
) -> None:
    run = committed(tmp_path, "run", fmt)
    finish_all(run)
    run.shard_folder(0).done_path.unlink()  # by hand: rows.* is now the only copy of the shard's rows
    assert [p.name for p in run.shard_folder(0).committed_files()] == [f"rows.{fmt}"]  # readers still find the rows
    done = work(run, 0)  # no engine: every row is committed, in rows.*
    assert done["compacted"] == f"rows.{fmt}" and read_json(run.shard_folder(0).done_path) == done
    assert run.shard_folder(0).compacted().read_bytes() == reference["compacted"][0]  # type: ignore[union-attr]
    merge(run)
    assert run.output_path.read_bytes() == reference["output"]


def test_a_hand_deleted_done_json_after_a_killed_cleanup_reseals_from_both(
    tmp_path: Path, fmt: str, reference: dict[str, Any]
) -> None:
    """A kill removed the first part only (DONE.json written), then DONE.json was deleted by hand:
    the compacted file holds rows no part holds, and the parts rows it holds too."""
    run = committed(tmp_path, "run", fmt)
    kept = {p.name: p.read_bytes() for p in run.shard_folder(0).part_files()[1:]}
    finish_all(run)
    for name, data in kept.items():
        (run.shard_dir(0) / name).write_bytes(data)
    run.shard_folder(0).done_path.unlink()
    assert sorted(set(run.shard_folder(0).read_rows().column("row").to_pylist())) == list(range(12))
    work(run, 0)
    assert listing(run, 0) == ["DONE.json", "lock", "progress.json", f"rows.{fmt}"]
    assert run.shard_folder(0).compacted().read_bytes() == reference["compacted"][0]  # type: ignore[union-attr]
    merge(run)
    assert run.output_path.read_bytes() == reference["output"]


def test_done_json_missed_by_a_first_read_never_costs_the_compacted_file(
    tmp_path: Path, fmt: str, reference: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """NFS negative lookup cache after a hand-off: the worker's first read of DONE.json answers ENOENT,
    later reads find it. The worker must not take rows.* (the only copy) for a leftover."""
    run = committed(tmp_path, "run", fmt)
    finish_all(run)
    sealed = read_json(run.shard_folder(0).done_path)
    real_read = shard_folder.read_json
    missed = []

    def read_json_once_missing(path: Path) -> Any:
        if path.name == "DONE.json" and not missed:
            missed.append(path)
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return real_read(path)

    monkeypatch.setattr(shard_folder, "read_json", read_json_once_missing)
    work(run, 0)
    monkeypatch.undo()
    assert missed == [run.shard_folder(0).done_path]  # the fault landed on the worker's read
    assert run.shard_folder(0).compacted().read_bytes() == reference["compacted"][0]  # type: ignore[union-attr]
    assert read_json(run.shard_folder(0).done_path)["compacted"] == sealed["compacted"]
    merge(run)
    assert run.output_path.read_bytes() == reference["output"]


@pytest.mark.parametrize("damage", ["missing", "short"])
def test_parts_are_kept_while_the_named_compacted_file_lacks_rows(tmp_path: Path, fmt: str, damage: str) -> None:
    """DONE.json names rows.*, parts are still there (a killed cleanup), and rows.* is gone or short:
    neither the worker nor merge removes the parts; both name the file and what to do."""
    run = committed(tmp_path, "run", fmt)
    parts = {p.name: p.read_bytes() for p in run.shard_folder(0).part_files()}
    finish_all(run)
    for name, data in parts.items():
        (run.shard_dir(0) / name).write_bytes(data)
    compacted = run.shard_dir(0) / f"rows.{fmt}"
    if damage == "missing":
        compacted.unlink()
    else:
        rows = run.shard_folder(0).read_rows().to_pylist()[:7]
        compacted.write_bytes(table_bytes(rows_to_table(rows, run.schema), fmt))
    what = "is missing" if damage == "missing" else "holds 7 rows of 12"
    with pytest.raises(RunDirError, match=rf"DONE.json names rows\.{fmt}, which {what}; .* Remove .*DONE.json"):
        work(run, 0)
    with pytest.raises(RunDirError, match=rf"names rows\.{fmt}, which {what}"):
        merge(run)
    assert sorted(p.name for p in run.shard_folder(0).part_files()) == sorted(parts)  # every part kept
    run.shard_folder(0).done_path.unlink()  # as the message says: the worker then seals from what is committed
    work(run, 0)
    assert run.shard_folder(0).read_rows().column("row").to_pylist() == list(range(12))
    assert listing(run, 0) == ["DONE.json", "lock", "progress.json", f"rows.{fmt}"]


def test_merge_checks_the_compacted_file_before_removing_leftover_parts(tmp_path: Path) -> None:
    run = committed(tmp_path, "run", "parquet")
    finish_all(run)
    (run.shard_dir(1) / "part-000000.parquet").write_bytes(
        table_bytes(rows_to_table([output_row(run, 12)], run.schema), "parquet")
    )
    merge(run)  # rows.parquet is whole: the leftover part goes
    assert not list(run.shard_dir(1).glob("part-*"))
    assert pq.ParquetFile(run.shard_dir(1) / "rows.parquet").metadata.num_rows == 12


@pytest.mark.parametrize(
    "when, refusal",
    [
        ("after-compact-rename", r"rows\.\w+: is gone \(removed meanwhile by another writer\)"),
        ("after-compact-done", r"names rows\.\w+, which is missing"),
    ],
)
def test_a_compacted_file_removed_by_a_second_writer_keeps_the_parts(
    tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch, when: str, refusal: str
) -> None:
    """Two writers (one an earlier incarnation that lost its lock): B removes A's compacted file as a
    leftover, before or just after A writes DONE.json. A must not then delete the parts, the only
    copy: it refuses, and the next seal makes the shard whole from the parts."""
    from batchinfer import faults

    run = committed(tmp_path, "race", fmt)
    real_point = faults.point

    def second_writer_cleans_up(name: str) -> None:
        if name == when:
            (run.shard_dir(0) / f"rows.{fmt}").unlink()  # B's cleanup of what it takes for a leftover
        real_point(name)

    before = {p.name: p.read_bytes() for p in run.shard_folder(0).committed_files()}
    monkeypatch.setattr(faults, "point", second_writer_cleans_up)
    with pytest.raises(RunDirError, match=refusal):
        run.shard_folder(0).finish({"rows_done": 12})
    kept = {p.name: p.read_bytes() for p in run.shard_folder(0).committed_files(None)}
    assert kept == before  # every committed part kept
    monkeypatch.setattr(faults, "point", real_point)
    run.shard_folder(0).done_path.unlink(missing_ok=True)  # what the error says to do
    record = run.shard_folder(0).finish({"rows_done": 12})
    assert record["compacted"] == f"rows.{fmt}" and rows_in(run.shard_dir(0) / f"rows.{fmt}", run) == 12
