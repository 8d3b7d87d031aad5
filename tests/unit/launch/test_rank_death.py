"""A rank of an engine over several nodes dies: its node's fault, not the rows'. The ranks' step is a
real process (what `srun` is on a cluster), killed while the head's engine (the fake engine) has
rows in flight; the head's engine then fails as it does when the ranks are gone. The failure is
counted, no row in flight becomes a suspect, and two such deaths turn no row into an error row."""

from __future__ import annotations

import json
import signal
import socket
from pathlib import Path
from typing import Any

import pytest
from support.corpus import read_output, write_corpus
from support.fake_engine import FakeEngine, fake_overrides, keyed

from batchinfer.config.compose import compose
from batchinfer.engine.completion import Completion
from batchinfer.engine.stopflag import StopFlag
from batchinfer.engine.worker import ShardWorker
from batchinfer.launch import ranks
from batchinfer.rundir.merge import merge
from batchinfer.rundir.prepare import prepare
from batchinfer.rundir.store import RunDir

ROWS = 40


class HeadEngine(FakeEngine):
    """The head's engine: at its step `at`, the ranks' process is killed (a node lost), and the
    step fails as the head's engine does once its ranks are gone (its collective cut off)."""

    def __init__(self, step: ranks.RankStep, at: int):
        super().__init__()
        self.rank_step, self.at = step, at

    def step(self) -> list[Completion]:
        if self.steps + 1 == self.at:
            assert self.rank_step.proc is not None
            self.rank_step.proc.send_signal(signal.SIGKILL)
            self.died_with = [ids for _, ids in self.queue]
            raise RuntimeError("vLLM engine core died")
        return super().step()


def two_node_run(tmp_path: Path) -> tuple[RunDir, list[dict[str, Any]]]:
    corpus = tmp_path / "c.jsonl"
    rows = write_corpus(corpus, ROWS)
    overrides = fake_overrides(
        tmp_path,
        corpus,
        "input.id_column=id",
        "cluster=slurm",
        "cluster.gpus_per_task=0",
        "cluster.nodes_per_task=2",
        "model.tensor_parallel_size=2",
        "output.commit_every_rows=4",
    )
    return prepare(compose(overrides)), rows


def ranks_alive(run: RunDir, monkeypatch: pytest.MonkeyPatch) -> ranks.RankStep:
    """The other node's ranks: a live process standing for their `srun` step."""
    monkeypatch.setattr(socket, "gethostbyname", lambda node: "127.0.0.1")
    step = ranks.RankStep(run, ["n1", "n2"], "n1")
    step.cmd = ["sleep", "600"]
    step.start()
    return step


def attempt(run: RunDir, engine: FakeEngine, step: ranks.RankStep) -> None:
    """One attempt of the shard on this engine, the worker told of the ranks (as ShardLoop does)."""
    worker = ShardWorker(run, lambda: keyed(engine, run), StopFlag())
    worker.node_fault = step.fault
    with pytest.raises(RuntimeError, match="engine core died"):
        worker.run_shard(run.shards()[0])


def progress(run: RunDir) -> dict[str, Any]:
    return json.loads(run.shard_folder(0).progress_path.read_text())


def test_a_dead_rank_charges_no_row_and_two_deaths_make_no_error_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ranks, "kill_engine_processes", lambda exclude: None)  # no engine processes here
    run, rows = two_node_run(tmp_path)
    for n in (1, 2):
        step = ranks_alive(run, monkeypatch)
        engine = HeadEngine(step, at=3)
        try:
            attempt(run, engine, step)
        finally:
            step.stop()
        assert engine.died_with  # rows were in flight when the node was lost
        p = progress(run)
        assert p["failures"] == n and "engine core died" in p["last_error"]
        assert p["suspects"] == {} and p.get("crashed", {}) == {}
    # the next attempt, on healthy nodes, answers every row: none was left out as an engine crash
    ShardWorker(run, lambda: keyed(FakeEngine(), run), StopFlag()).run_shard(run.shards()[0])
    out = read_output(merge(run) and run.path)
    assert [r["row"] for r in out] == list(range(ROWS)) and all(r["error"] is None for r in out)


def test_with_the_ranks_alive_an_engine_death_still_charges_the_rows_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ranks, "NODE_FAULT_WAIT_S", 0.2)
    run, rows = two_node_run(tmp_path)
    step = ranks_alive(run, monkeypatch)
    engine = FakeEngine(poison=[rows[5]["text"]])  # the head's own engine dies on a row
    try:
        attempt(run, engine, step)
        assert step.proc is not None and step.proc.poll() is None  # the ranks live on
    finally:
        step.stop()
    in_flight = {i for i, r in enumerate(rows) if engine.ids(r["text"]) in (engine.died_with or [])}
    assert 5 in in_flight and progress(run)["suspects"] == {str(i): 1 for i in sorted(in_flight)}
