"""A tune trial of a setting whose task runs two engines, on the stand-in engine: each rung is a run
directory of one shard per engine, run by two engine processes started for it (as a task starts
them), measured as the task's rate with the engines' start-up apart; the same rung on one engine
answers every row the same; a trial killed over its time takes its engine processes with it."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.corpus import read_output, write_corpus
from support.runs import model_overrides
from support.standin import STEP_ENV, standin_env

from batchinfer.tune.halving import TrialFailed
from batchinfer.tune.process import TrialProcess
from batchinfer.tune.settings import Setting
from batchinfer.tune.trial import serve

TWO = "cluster.engines_per_task=2"
MEMBER = "batchinfer.launch.member"


@pytest.fixture
def standin(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stand-in engine here and in every process started from here (the engine processes)."""
    for key, value in standin_env({}).items():
        monkeypatch.setenv(key, value)


def spec(tmp: Path, model: Path, name: str, *setting: str, rungs: tuple[int, ...] = (12, 20)) -> dict[str, Any]:
    """A trial spec over disjoint slices of one corpus, as tune writes them (rungs/rung-R.parquet)."""
    rows = write_corpus(tmp / "corpus.jsonl", sum(rungs), seed=7)
    paths, start = [], 0
    for r, size in enumerate(rungs):
        path = tmp / f"rung-{r}.parquet"
        pq.write_table(pa.Table.from_pylist(rows[start : start + size]), path)
        paths.append(str(path))
        start += size
    base = ["input.id_column=id", "sampling.max_tokens=6", *model_overrides(model)]
    return {"overrides": [*base, *setting], "config_dir": None, "rungs": paths, "out": str(tmp / name)}


def serve_all(s: dict[str, Any]) -> list[dict[str, Any]]:
    answers: list[dict[str, Any]] = []
    serve(s, answers.append, iter([f"go {r}\n" for r in range(len(s["rungs"]))] + ["stop\n"]))
    return answers


def test_a_task_of_two_engines_runs_each_rung_as_a_task(tmp_path: Path, tiny_model_path: Path, standin: None) -> None:
    two = serve_all(spec(tmp_path, tiny_model_path, "two", TWO))
    assert two[0] == {"event": "ready", "startup_seconds": None}  # no engine to share
    assert [a["event"] for a in two[1:]] == ["rung", "rung"], two
    for r, (answer, rows) in enumerate(zip(two[1:], (12, 20), strict=True)):
        run = tmp_path / "two" / f"rung-{r}"
        done = [json.loads(p.read_text()) for p in sorted(run.glob("shards/*/DONE.json"))]
        # one shard per engine, run by engine processes of a task of two, started for this rung
        # (which engine takes which: the first to be ready may take both)
        assert len(done) == 2 and {d["engine"]["index"] for d in done} <= {0, 1}
        assert all(d["engine"]["of"] == 2 and d["engine"]["startup_seconds"] > 0 for d in done)
        assert answer["engines"] == 2 and answer["rows"] == rows == sum(d["rows_done"] for d in done)
        out = read_output(run)
        assert answer["output_tokens"] == sum(d["output_tokens"] for d in done) == sum(o["output_tokens"] for o in out)
        assert sorted(answer["output_lengths"]) == sorted(o["output_tokens"] for o in out)
        # the task's rate: the engines' generate seconds shared between the two, start-up apart
        assert answer["generate_seconds"] == pytest.approx(sum(d["seconds"]["generate"] for d in done) / 2)
        assert answer["startup_seconds"] == round(max(d["engine"]["startup_seconds"] for d in done), 2)
        assert answer["peak_memory_mb"] > 0
    # the same rungs on one engine, built once: every row answered the same, measured per engine
    one = serve_all(spec(tmp_path, tiny_model_path, "one"))
    assert one[0]["event"] == "ready" and one[0]["startup_seconds"] > 0
    assert all(a["engines"] == 1 and a["startup_seconds"] is None for a in one[1:])
    for r in range(2):
        by_one = {o["id"]: o["text"] for o in read_output(tmp_path / "one" / f"rung-{r}")}
        by_two = {o["id"]: o["text"] for o in read_output(tmp_path / "two" / f"rung-{r}")}
        assert by_one == by_two and len(by_two) == (12, 20)[r]
        assert len(list((tmp_path / "one" / f"rung-{r}").glob("shards/*/DONE.json"))) == 1


def members_of(folder: Path) -> list[psutil.Process]:
    """Engine processes of a task whose run directory is under folder."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if MEMBER in cmd and any(str(folder) in a for a in cmd):
            found.append(p)
    return found


def test_a_trial_killed_over_its_time_kills_its_engines(
    tmp_path: Path, tiny_model_path: Path, standin: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The task's engine processes have process groups of their own: killing the trial's group
    alone would leave them running their shards (and holding their GPUs) beside the next trial."""
    monkeypatch.setenv(STEP_ENV, "60")  # a shard of the rung takes minutes: its engines would outlive the trial
    s = spec(tmp_path, tiny_model_path, "runs", TWO, rungs=(40,))
    trial = TrialProcess(Setting((TWO,)), s, tmp_path / "trial")
    try:
        assert trial.start(timeout=300) is None
        assert trial.proc is not None and trial.proc.stdin is not None
        trial.proc.stdin.write("go 0\n")
        trial.proc.stdin.flush()
        # both engines started and took their shard (its lock): each is in a step of a minute
        locks = [tmp_path / "runs" / "rung-0" / "shards" / f"{i:05d}" / "lock" for i in range(2)]
        deadline = time.monotonic() + 300
        while not all(p.exists() for p in locks) and time.monotonic() < deadline:
            time.sleep(0.5)
        members = members_of(tmp_path / "runs")
        assert len(members) == 2 and all(p.exists() for p in locks), (tmp_path / "trial" / "trial.log").read_text()[
            -3000:
        ]
        with pytest.raises(TrialFailed, match="over its time: rung 0 took more than 1 s"):
            trial._answer(1.0, "rung 0")  # what the parent does when a rung is over its time
        _, alive = psutil.wait_procs(members, timeout=20)  # killed with the trial, not at their shard's end
        assert alive == [] and members_of(tmp_path / "runs") == []
    finally:
        trial.stop()
        for p in members_of(tmp_path / "runs"):
            p.kill()
