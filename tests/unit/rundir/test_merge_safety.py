"""merge replaces only what a merge of the run wrote (stats.json, or the record of a merge killed
before it, names it): a file or folder of someone else's at the output's name is refused, unchanged
(issue 26). No engine: shards are committed and finished as a worker does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.parts import committed, finish_all

from batchinfer.durable import read_json
from batchinfer.errors import RunDirError
from batchinfer.rundir.merge import merge
from batchinfer.rundir.output_swap import MERGING


def test_a_file_no_merge_wrote_is_refused_and_kept(tmp_path: Path) -> None:
    run = committed(tmp_path, "run", "parquet")
    finish_all(run)
    run.output_path.write_bytes(b"someone's own parquet")
    with pytest.raises(RunDirError, match=r"output.parquet was not written by a merge of this run"):
        merge(run)
    assert run.output_path.read_bytes() == b"someone's own parquet"


def test_a_merge_replaces_its_own_output_and_leaves_no_record(tmp_path: Path) -> None:
    run = committed(tmp_path, "run", "parquet")
    finish_all(run)
    merge(run)
    first = run.output_path.read_bytes()
    assert read_json(run.stats_json)["files"] == ["output.parquet"] and not (run.path / MERGING).exists()
    merge(run)
    assert run.output_path.read_bytes() == first


def test_a_folder_with_files_no_merge_wrote_is_refused_and_kept(tmp_path: Path) -> None:
    run = committed(tmp_path, "run", "parquet", 2, 24, "output.max_rows_per_file=5")
    finish_all(run)
    merge(run)
    files = sorted(p.name for p in run.output_path.iterdir())
    assert files == [f"output-{i:05d}-of-00005.parquet" for i in range(5)], files
    (run.output_path / "analysis.ipynb").write_text("{}")
    with pytest.raises(RunDirError, match=r"holds files no merge of this run wrote \(analysis.ipynb\)"):
        merge(run)
    assert (run.output_path / "analysis.ipynb").read_text() == "{}"
    assert sorted(p.name for p in run.output_path.iterdir()) == sorted([*files, "analysis.ipynb"])


def test_a_merge_killed_after_its_rename_is_followed_by_one_that_replaces_it(tmp_path: Path) -> None:
    run = committed(tmp_path, "run", "jsonl")
    finish_all(run)
    merge(run)
    merged = run.output_path.read_bytes()
    # killed between putting output.jsonl in place and writing stats.json: only its record says so
    (run.path / MERGING).write_text(json.dumps({"output": "output.jsonl", "files": ["output.jsonl"]}))
    run.stats_json.unlink()
    merge(run)
    assert run.output_path.read_bytes() == merged and run.stats_json.is_file()
    assert not (run.path / MERGING).exists()
