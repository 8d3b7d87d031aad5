"""A shard folder's cleanup, one method per job: a killed writer's temporaries, a killed
compaction's leftovers, and both under the shard lock; the files holding a shard's rows
(committed_files) apart from every part file in the folder (part_files) (issue 28)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from support.parts import DONE, committed, finish_all

from batchinfer.durable import read_json, write_json
from batchinfer.errors import RunDirError


def test_temporaries_and_compaction_leftovers_are_removed_by_their_own_methods(tmp_path: Path, fmt: str) -> None:
    run = committed(tmp_path, "run", fmt)
    folder = run.shard_dir(0)
    stray = folder / f"rows.{fmt}"  # a killed compaction's copy: the parts hold every row
    stray.write_bytes(b"a killed compaction's file")
    temporary = folder / f".tmp-part-000009.{fmt}.1-abc"
    temporary.write_bytes(b"half")
    parts = sorted(p.name for p in run.shard_folder(0).part_files())

    assert run.shard_folder(0).remove_temporaries() == 1
    assert not temporary.exists() and stray.exists()  # the temporary only

    temporary.write_bytes(b"half")
    assert run.shard_folder(0).remove_compaction_leftovers(None) == 1
    assert not stray.exists() and temporary.exists()  # the compaction leftover only
    assert sorted(p.name for p in run.shard_folder(0).part_files()) == parts  # the parts hold the rows: kept


def test_a_refused_cleanup_removes_nothing_not_even_temporaries(tmp_path: Path, fmt: str) -> None:
    """DONE.json names a compacted file that is missing: the parts are the only copy, so nothing
    goes (as before the split into two methods)."""
    run = committed(tmp_path, "run", fmt)
    folder = run.shard_dir(0)
    write_json(run.shard_folder(0).done_path, dict(DONE, compacted=f"rows.{fmt}"))
    temporary = folder / f".tmp-rows.{fmt}.1-abc"
    temporary.write_bytes(b"half")
    before = sorted(p.name for p in folder.iterdir())
    with pytest.raises(RunDirError, match=rf"names rows\.{fmt}, which is missing"):
        run.shard_folder(0).remove_temporaries_and_leftovers()
    assert sorted(p.name for p in folder.iterdir()) == before


def test_committed_files_are_the_compacted_file_while_part_files_lists_leftover_parts(tmp_path: Path, fmt: str) -> None:
    run = committed(tmp_path, "run", fmt)
    part = run.shard_folder(0).part_files()[0]
    kept = part.read_bytes()
    finish_all(run)
    shutil.copyfile(tmp_path / "corpus.jsonl", part.with_name("unrelated.txt"))  # not a part: never listed
    part.write_bytes(kept)  # a sealed shard's leftover part (removed meanwhile by the sealing)
    compacted = run.shard_folder(0).compacted()
    assert compacted is not None and compacted.name == read_json(run.shard_folder(0).done_path)["compacted"]
    assert run.shard_folder(0).committed_files() == [compacted]
    assert run.shard_folder(0).part_files() == [part]
    assert run.shard_folder(0).remove_temporaries_and_leftovers() == 1 and run.shard_folder(0).part_files() == []
