"""A template file edited between attempts, on the shared engine: the frozen copy is what runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support.corpus import assert_own_output, read_output, write_corpus
from support.runs import fake_model_dir, run_overrides

from batchinfer.config.compose import compose
from batchinfer.errors import RunDirError
from batchinfer.rundir.prepare import prepare
from batchinfer.rundir.store import RunDir


@pytest.mark.engine
def test_template_file_edited_between_attempts(tmp_path: Path, tiny_model_path: Path, engine: Any, monkeypatch) -> None:
    from batchinfer.launch.local import run_shards
    from batchinfer.rundir.merge import merge

    monkeypatch.chdir(tmp_path)
    corpus = tmp_path / "c.jsonl"
    rows = write_corpus(corpus, 24, seed=9)
    Path("t.txt").write_text("Topic of: {text} fox")  # the tiny model repeats the last word: fox
    ov = run_overrides(tiny_model_path, corpus, tmp_path / "run", "prompt.template_file=t.txt", "sharding.num_shards=2")
    run = prepare(compose(ov))
    run_shards(run, [0], engine)  # the first attempt stops after shard 0
    Path("t.txt").write_text("Topic of: {text} dog")
    monkeypatch.chdir(fake_model_dir(tmp_path))  # a task starts elsewhere, as on a cluster
    again = RunDir(tmp_path / "run")  # what `batchinfer worker DIR TASK` opens
    run_shards(again, [1], engine)
    merge(again)
    out = read_output(again.path)
    assert [r["id"] for r in out] == [r["id"] for r in rows]
    for r in out:
        assert r["error"] is None and "dog" not in r["text"]
        assert_own_output(r, "fox")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RunDirError, match=r"prompt.template_file contents"):
        prepare(compose(ov))
