"""A merge SIGKILLed half way, before its rename, or while swapping a folder output restarts
cleanly: the next merge writes the same bytes as an uninterrupted one and leaves no temporary
(issue 16). No engine: shards are committed and compacted as a worker does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support.parts import committed, finish_all

from batchinfer.rundir.merge import merge
from batchinfer.rundir.store import RunDir

SHARDS = 4  # "in-merge" fires after shard 2 of 4: half the output is written


def output_files(run: RunDir) -> dict[str, bytes]:
    """The merged output, file name -> bytes (one file, or the split files of DIR/output)."""
    out = run.output_path
    if out.is_dir():
        return {p.name: p.read_bytes() for p in sorted(out.iterdir())}
    return {out.name: out.read_bytes()}


def finished(tmp_path: Path, name: str, fmt: str, split: bool) -> RunDir:
    run = committed(tmp_path, name, fmt, SHARDS, 24, *(["output.max_rows_per_file=5"] if split else []))
    finish_all(run)
    return run


def merge_killed_at(run: RunDir, fault: str) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "batchinfer.cli", "merge", str(run.path)],
        env={**os.environ, "BATCHINFER_FAULT": fault},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == -signal.SIGKILL, res.stderr[-2000:]


def temporaries(run: RunDir) -> list[Path]:
    return sorted(run.path.glob(".tmp-*"))


@pytest.mark.parametrize("split", [False, True], ids=["one-file", "split"])
@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
@pytest.mark.parametrize("fault", ["in-merge", "before-merge-rename"])
def test_a_merge_killed_then_merged_again_writes_the_same_bytes(
    tmp_path: Path, fmt: str, split: bool, fault: str
) -> None:
    reference = finished(tmp_path, "reference", fmt, split)
    merge(reference)
    expected = output_files(reference)
    assert len(expected) == (5 if split else 1)  # 24 rows in files of at most 5
    run = finished(tmp_path, "killed", fmt, split)
    merge_killed_at(run, fault)
    assert not run.output_path.exists() and not run.stats_json.exists()
    (tmp,) = temporaries(run)  # the killed merge's own name
    assert tmp.name.endswith(run.output_path.name)
    if split:
        written = {p.name: p.read_bytes() for p in sorted(tmp.iterdir())}
    else:
        written = {run.output_path.name: tmp.read_bytes()}
    if fault == "before-merge-rename":
        assert written == expected  # complete, only the rename was missing
    else:
        assert written != expected  # half written
    stats = merge(run)
    assert stats["rows"] == 24
    assert output_files(run) == expected
    assert temporaries(run) == []


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_a_merge_killed_while_swapping_a_folder_output_then_merged_again(tmp_path: Path, fmt: str) -> None:
    """A second merge of a split output moves the old folder aside before putting the new one in place."""
    run = finished(tmp_path, "run", fmt, split=True)
    merge(run)
    expected = output_files(run)
    merge_killed_at(run, "in-merge-swap")
    assert not run.output_path.exists()
    names = [p.name for p in temporaries(run)]
    assert len(names) == 2 and sum("-old-output" in n for n in names) == 1  # the old folder and the new one
    merge(run)
    assert output_files(run) == expected
    assert temporaries(run) == []
