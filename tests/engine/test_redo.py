"""`redo` on the real engine (the session engine): a first run with a small sampling.max_tokens leaves
rows at finish_reason "length"; redo --where 'finish_reason == "length"' with more tokens changes
exactly those rows, the others stay value for value, and each id is in the output once with `pass` set."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support.corpus import assert_own_output, read_output, write_corpus
from support.runs import committed_rows, run_overrides

from batchinfer.config.compose import compose
from batchinfer.launch.local import run_local
from batchinfer.launch.redo import redo

pytestmark = pytest.mark.engine

LENGTH = 'finish_reason == "length"'


def first_run(tmp_path: Path, model: Path, engine: Any, n: int, *extra: str) -> tuple[Any, list[dict]]:
    """n rows at max_tokens=3; rows ending in "dog" stop at once (sampling.stop), the rest at length."""
    corpus = tmp_path / "c.jsonl"
    rows = write_corpus(corpus, n, seed=21)
    ov = run_overrides(model, corpus, tmp_path / "run", "sampling.max_tokens=3", "sampling.stop=dog", *extra)
    return run_local(compose(ov), engine=engine), rows


def test_redo_changes_exactly_the_rows_at_length(tmp_path: Path, tiny_model_path: Path, engine: Any) -> None:
    run, rows = first_run(tmp_path, tiny_model_path, engine, 60, "sharding.num_shards=2")
    before = read_output(run.path)
    length = [r["row"] for r in before if r["finish_reason"] == "length"]
    assert 10 < len(length) < 60 and all(r["output_tokens"] == 3 for r in before if r["row"] in length)
    parts = committed_rows(run.path)
    redo(str(run.path), LENGTH, ["sampling.max_tokens=7"], engine=engine)
    after = read_output(run.path)
    assert [r["row"] for r in after] == list(range(60))
    assert [r["id"] for r in after] == [r["id"] for r in rows]  # each id once, in input order
    assert [r["row"] for r in after if r["pass"] == 1] == length
    for old, new, inp in zip(before, after, rows, strict=True):
        if new["pass"] == 1:  # answered again with 7 tokens: still the row's own answer
            assert new["output_tokens"] == 7 and new["finish_reason"] == "length" and new["text"] != old["text"]
            assert new["text"].startswith(old["text"]) and new["prompt_tokens"] == old["prompt_tokens"]
            assert_own_output(new, inp["text"])
        else:
            assert new == dict(old, **{"pass": 0})
    assert committed_rows(run.path) == parts  # the run's own committed rows are untouched
