"""`batchinfer redo` on the stand-in engine: a pass over the selected rows with overrides, merged back
in place with a `pass` column; each id once, in input order; an unfinished pass leaves the output as
it was; passes of passes select from the latest merged view."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from support.corpus import assert_own_output, read_output, write_corpus
from support.runs import run_overrides
from support.standin import StandinEngine

from batchinfer.config.compose import compose
from batchinfer.errors import ConfigError, RunDirError
from batchinfer.launch.local import run_local
from batchinfer.launch.redo import new_pass, redo
from batchinfer.rundir.merge import merge
from batchinfer.rundir.passes import SOURCE_ROW, finished_passes, pass_path, read_record
from batchinfer.rundir.splice import select_rows, view_schema
from batchinfer.rundir.store import RunDir
from batchinfer.rundir.where import compile_where

LENGTH = 'finish_reason == "length"'


def output_bytes(run: RunDir) -> dict[str, bytes]:
    """The merged output's files and their bytes."""
    out = run.output_path
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())} if out.is_dir() else {out.name: out.read_bytes()}


@pytest.fixture
def first(tmp_path: Path, tiny_model_path: Path, request: pytest.FixtureRequest) -> dict[str, Any]:
    """A finished run of 80 rows at max_tokens=4 (some rows stop at `length`): Parquet output, JSON
    lines (parts too), output files of at most 30 rows, or a Parquet input (read in place)."""
    kind = getattr(request, "param", "parquet")
    corpus = tmp_path / ("c.parquet" if kind == "parquet-input" else "c.jsonl")
    rows = write_corpus(corpus, 80, seed=11, fmt="parquet" if kind == "parquet-input" else "jsonl")
    fmt = {"jsonl": ["output.format=jsonl"], "split": ["output.max_rows_per_file=30"]}.get(kind, [])
    ov = run_overrides(
        tiny_model_path, corpus, tmp_path / "run", "sampling.max_tokens=4", "sharding.num_shards=3", *fmt
    )
    cfg = compose(ov)
    run = run_local(cfg, engine=StandinEngine(cfg))
    out = read_output(run.path)
    return {"run": run, "rows": rows, "out": out, "cfg": cfg}


@pytest.mark.parametrize("first", ["parquet", "jsonl", "split", "parquet-input"], indirect=True)
def test_redo_changes_exactly_the_selected_rows_and_merges_them_in_place(first: dict[str, Any]) -> None:
    run, before = first["run"], first["out"]
    length = [r["row"] for r in before if r["finish_reason"] == "length"]
    assert 5 < len(length) < 40
    redo(str(run.path), LENGTH, ["sampling.max_tokens=9"], engine=StandinEngine(first["cfg"]))
    after = read_output(run.path)
    # every input row once, in input order, with its id; the pass column says who answered it
    assert [r["row"] for r in after] == list(range(80))
    assert [r["id"] for r in after] == [r["id"] for r in first["rows"]]
    assert [r["row"] for r in after if r["pass"] == 1] == length
    for old, new, inp in zip(before, after, first["rows"], strict=True):
        if old["row"] in length:  # answered again, at 9 tokens: the row's own answer
            assert new["output_tokens"] != old["output_tokens"] or new["finish_reason"] != "length"
            assert_own_output(new, inp["text"])
        else:
            assert dict(new) == dict(old, **{"pass": 0})  # untouched, value for value
    # the pass is a run directory of its own: its config, its input with the source rows
    p = RunDir(pass_path(run, 1))
    assert p.config.sampling.max_tokens == 9 and p.run["fingerprint"] != run.run["fingerprint"]
    assert pq.read_table(p.path / "selection.parquet").column(SOURCE_ROW).to_pylist() == length
    assert read_record(p.path).rows == len(length) and read_record(p.path).overrides == ["sampling.max_tokens=9"]
    stats = json.loads(run.stats_json.read_text())
    assert stats["passes"] == {"0": 80 - len(length), "1": len(length)} and stats["rows"] == 80


def test_the_same_command_after_the_pass_finished_makes_a_pass_of_the_rest(first: dict[str, Any]) -> None:
    run, cfg = first["run"], first["cfg"]
    redo(str(run.path), LENGTH, ["sampling.max_tokens=5"], engine=StandinEngine(cfg))
    mid = read_output(run.path)
    still = [r["row"] for r in mid if r["finish_reason"] == "length"]
    assert still  # at 5 tokens some rows stop at length again
    assert list(select_rows(run, compile_where(f"pass == 1 and {LENGTH}", view_schema(run)))) == [
        r["row"] for r in mid if r["pass"] == 1 and r["finish_reason"] == "length"
    ]
    redo(str(run.path), f"pass == 1 and {LENGTH}", ["sampling.max_tokens=40"], engine=StandinEngine(cfg))
    last = read_output(run.path)
    redone = [r["row"] for r in mid if r["pass"] == 1 and r["finish_reason"] == "length"]
    assert [r["row"] for r in last if r["pass"] == 2] == redone
    assert [r["id"] for r in last] == [r["id"] for r in first["rows"]]
    keep = [(a, b) for a, b in zip(mid, last, strict=True) if a["row"] not in redone]
    assert all(a == b for a, b in keep)  # rows of passes 0 and 1 not selected again are as they were
    assert json.loads(run.stats_json.read_text())["passes"]["2"] == len(redone)


@pytest.mark.parametrize("first", ["parquet", "split"], indirect=True)
def test_an_unfinished_pass_leaves_the_output_as_it_was(first: dict[str, Any], tmp_path: Path) -> None:
    run = first["run"]
    output = output_bytes(run)
    stats = run.stats_json.read_bytes()
    # a pass prepared but not run (a redo killed before its first commit)
    new_pass(run, LENGTH, ["sampling.max_tokens=9"])
    rows = select_rows(run, compile_where(LENGTH, view_schema(run)))
    assert finished_passes(run) == []
    merge(run)
    assert output_bytes(run) == output and run.stats_json.read_bytes() == stats
    # another command while it is unfinished is refused, naming it
    with pytest.raises(
        RunDirError, match=r"passes/1 \(--where 'finish_reason == \"length\"' sampling.max_tokens=9\) is not finished"
    ):
        redo(str(run.path), "error is not null", [])
    # the same command finishes it, then merge puts it in place
    redo(str(run.path), LENGTH, ["sampling.max_tokens=9"], engine=StandinEngine(first["cfg"]))
    assert [r["row"] for r in read_output(run.path) if r["pass"] == 1] == list(rows)


def test_refusals(first: dict[str, Any]) -> None:
    run = first["run"]
    with pytest.raises(ConfigError, match="input.path=/x.jsonl: a pass sets input.path itself"):
        redo(str(run.path), LENGTH, ["input.path=/x.jsonl"])
    with pytest.raises(ConfigError, match="the output has no field 'finish'"):
        redo(str(run.path), "finish == 1", [])
    with pytest.raises(RunDirError, match=r"change the output's columns: label \(absent -> string\)"):
        redo(str(run.path), LENGTH, ["prompt.labels.names=[a,b]"], engine=StandinEngine(first["cfg"]))
    assert not (run.path / "passes" / "1").exists()  # the refused pass left nothing behind
    redo(str(run.path), 'id == "nope"', [])
    assert not (run.path / "passes" / "1").exists()  # nothing matched: no pass


def test_redo_overrides_win_over_the_rows_own_sampling_and_status_says_so(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    """Rows whose input.sampling_column says max_tokens 4, redone with sampling.max_tokens=24: the pass
    computes them with 24 (the stand-in answers up to max_tokens tokens), keeps the rows' other own
    values, and the pass's line in status says which key wins (issue 41)."""
    from batchinfer.insight.passes import status_section

    corpus = tmp_path / "c.jsonl"
    rows = write_corpus(corpus, 40, seed=12)
    with corpus.open("w") as f:
        for r in rows:
            f.write(json.dumps(dict(r, params={"max_tokens": 4, "stop": ["zzz"]})) + "\n")
    ov = run_overrides(tiny_model_path, corpus, tmp_path / "run", "input.sampling_column=params")
    cfg = compose(ov)
    run = run_local(cfg, engine=StandinEngine(cfg))
    assert max(r["output_tokens"] for r in read_output(run.path)) <= 4
    redo(str(run.path), "row >= 0", ["sampling.max_tokens=24"], engine=StandinEngine(cfg))
    after = read_output(run.path)
    assert all(r["pass"] == 1 for r in after) and max(r["output_tokens"] for r in after) > 4
    own = RunDir(pass_path(run, 1)).config
    assert list(own.input.sampling_overridden) == ["max_tokens"]
    _, text = status_section(run)
    assert "its sampling.max_tokens wins over the rows' own values" in text
