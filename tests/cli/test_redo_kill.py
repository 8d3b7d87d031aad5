"""A `batchinfer redo` subprocess SIGKILLed (its whole group, vLLM's processes too) right after its
first part is committed, then the same command: the committed pass rows are unchanged, only the
rest is computed, and the output has each id once."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
from support.corpus import assert_own_output, read_output, write_corpus
from support.procs import group_alive, run_cli
from support.runs import assert_only_missing_rows_redone, committed_rows, recorded_commits, run_overrides

from batchinfer.config.compose import compose
from batchinfer.faults import AFTER_PART_RENAME, ENV
from batchinfer.launch.local import run_local
from batchinfer.launch.redo import redo

pytestmark = [pytest.mark.engine, pytest.mark.kill]

LENGTH = 'finish_reason == "length"'


def test_sigkill_after_the_first_pass_part_then_the_same_command(
    tmp_path: Path, tiny_model_path: Path, engine: Any, clean_shm: None
) -> None:
    corpus = tmp_path / "c.jsonl"
    rows = write_corpus(corpus, 80, seed=22)
    ov = run_overrides(tiny_model_path, corpus, tmp_path / "run", "sampling.max_tokens=3", "sampling.stop=dog")
    root = run_local(compose(ov), engine=engine)
    before = read_output(root.path)
    length = [r["row"] for r in before if r["finish_reason"] == "length"]
    output = root.output_path.read_bytes()
    args = ["sampling.max_tokens=7", "output.commit_every_rows=4"]
    res = run_cli(["redo", str(root.path), "--where", LENGTH, *args], env={ENV: f"{AFTER_PART_RENAME}:1"})
    assert res.returncode == -signal.SIGKILL, res.stderr[-3000:]
    assert group_alive(res.pid) == []  # no engine process outlives the kill
    pass_dir = root.path / "passes" / "1"
    parts = sorted(pass_dir.glob("shards/*/part-*"))
    assert len(parts) == 1  # the fault landed right after the first part was committed
    committed = committed_rows(pass_dir)
    assert 0 < len(committed) < len(length)
    assert root.output_path.read_bytes() == output  # an unfinished pass leaves the output as it was
    with recorded_commits() as redone:
        redo(str(root.path), LENGTH, args, engine=engine)
    assert_only_missing_rows_redone(pass_dir, committed, redone, len(length))
    after = read_output(root.path)
    assert [r["id"] for r in after] == [r["id"] for r in rows] and [r["row"] for r in after] == list(range(80))
    assert [r["row"] for r in after if r["pass"] == 1] == length
    for new, inp in zip(after, rows, strict=True):
        if new["pass"] == 1:
            assert new["output_tokens"] == 7
            assert_own_output(new, inp["text"])
