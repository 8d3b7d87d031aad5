"""The shard worker on the stand-in engine: commits, dedup, stop and resume, work order, trace and hold."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from support.corpus import read_output, write_corpus
from support.fake_engine import FakeEngine, fake_overrides, keyed, prepared

from batchinfer.config.compose import compose
from batchinfer.engine.stopflag import StopFlag
from batchinfer.engine.vllm_engine import Completion
from batchinfer.errors import EngineFailure, Stopped
from batchinfer.inputs.shards import Shard
from batchinfer.launch.local import run_shards
from batchinfer.rundir.merge import merge
from batchinfer.rundir.prepare import prepare
from batchinfer.rundir.store import RunDir


def test_fake_engine_run_commits_often_dedupes_and_merges_in_order(tmp_path: Path) -> None:
    corpus = tmp_path / "c.jsonl"
    rows = write_corpus(corpus, 30)
    rows[5]["text"] = rows[7]["text"] = rows[9]["text"] = "same prompt"
    rows[11]["text"] = None
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = prepare(
        compose(
            fake_overrides(
                tmp_path, corpus, "input.id_column=id", "sharding.num_shards=2", "output.commit_every_rows=4"
            )
        )
    )
    eng = FakeEngine()
    run_shards(run, [0, 1], engine=keyed(eng, run))
    assert sum(1 for ids in eng.added if ids == eng.encode([{"content": "same prompt"}])) == 1
    stats = merge(run)
    out = read_output(run.path)
    assert [r["row"] for r in out] == list(range(30))
    assert [r["id"] for r in out] == [r["id"] for r in rows]
    assert out[7]["text"] == out[9]["text"] == FakeEngine.answer(eng.encode([{"content": "same prompt"}]))
    # every other row its own answer: made from its own prompt's token ids
    for r, x in zip(out, rows, strict=True):
        if r["error"] is None:
            assert r["text"] == FakeEngine.answer(eng.encode([{"content": x["text"]}])), r
    assert out[11]["error"] == {"kind": "prompt", "message": "row 11: field 'text' is null or missing"}
    assert stats["rows"] == 30 and stats["errors"] == {"prompt": 1}
    done = json.loads(run.shard_folder(0).done_path.read_text())
    assert done["parts"] >= 3  # committed between steps, not once at the end (then compacted)
    assert done["device"] == "fake device" and done["model"]["path"] == run.run["config"]["model"]["path"]


def test_stop_flag_commits_then_resume_finishes(tmp_path: Path) -> None:
    from batchinfer.engine.worker import ShardWorker

    run = prepared(tmp_path, 20, "output.commit_every_rows=100")
    stop = StopFlag()
    eng = FakeEngine(per_step=3)
    real_step = eng.step

    def step_then_signal() -> list[Completion]:
        stop.signum = 15
        return real_step()

    eng.step = step_then_signal  # type: ignore[method-assign]
    with pytest.raises(Stopped):
        ShardWorker(run, lambda: eng, stop).run_shard(Shard(0, 0, 20))
    assert run.shard_folder(0).read_rows().num_rows == 3 and not run.shard_folder(0).is_done()
    second = FakeEngine()
    run_shards(run, [0], engine=keyed(second, run))
    assert len(second.added) == 17  # only what was missing
    assert [r["row"] for r in read_output(merge(run) and run.path)] == list(range(20))


def test_work_order_groups_shared_prefixes_then_sorts_by_length() -> None:
    from batchinfer.engine.feed import PREFIX_TOKENS, work_order
    from batchinfer.requests.request import RequestKey

    a, b = tuple(range(PREFIX_TOKENS)), tuple(range(100, 100 + PREFIX_TOKENS))
    keys = [
        RequestKey(b + (1, 2, 3), ""),
        RequestKey(a + (9,) * 10, ""),
        RequestKey(b + (5,), ""),
        RequestKey(a + (7,), ""),
    ]
    ordered = sorted(keys, key=work_order)
    assert [len(k.ids) - PREFIX_TOKENS for k in ordered] == [1, 10, 1, 3]
    assert [k.ids[:PREFIX_TOKENS] for k in ordered] == [a, a, b, b]


def test_trace_records_rows_finished_per_step(tmp_path: Path, monkeypatch) -> None:
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 20)
    run = prepare(compose(fake_overrides(tmp_path, corpus, "output.commit_every_rows=4")))
    trace = tmp_path / "trace.txt"
    monkeypatch.setenv("BATCHINFER_TRACE", str(trace))
    run_shards(run, [0], engine=keyed(FakeEngine(), run))
    counts = [int(line.split()[1]) for line in trace.read_text().splitlines()]
    assert counts == sorted(counts) and counts[-1] == 20  # what redo_bench compares with committed rows


def hold_endings(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """How each hold the worker enters ends: True when stopped() said so, False when its time ran out."""
    from batchinfer import faults

    real, ended = faults.hold, []

    def hold(stopped: Any) -> None:
        real(stopped)
        ended.append(stopped())

    monkeypatch.setattr(faults, "hold", hold)
    return ended


def test_hold_waits_after_the_first_commit_until_a_stop_signal(tmp_path: Path, monkeypatch) -> None:
    """BATCHINFER_HOLD: the Slurm tests' way to signal a shard that is surely partial."""
    from batchinfer import faults

    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 20)
    run = prepare(compose(fake_overrides(tmp_path, corpus, "output.commit_every_rows=4")))
    monkeypatch.setenv("BATCHINFER_HOLD", "60")
    monkeypatch.setattr(faults, "_held", False)
    real_hold = faults.hold
    ended = hold_endings(monkeypatch)
    seen: list[int] = []

    def stop_during_hold() -> None:  # the hold's sleep is where the signal lands
        time.sleep(0.5)
        seen.append(RunDir(run.path).shard_folder(0).read_rows().num_rows)
        if not run.shard_folder(0).is_done():  # a finished run has no handler left: USR2 would end pytest
            os.kill(os.getpid(), signal.SIGUSR2)

    threading.Thread(target=stop_during_hold).start()
    with pytest.raises(Stopped):
        run_shards(run, [0], engine=keyed(FakeEngine(), run))
    assert ended == [True] and seen and 0 < seen[0] < 20  # held on a partial shard until the signal
    assert 0 < run.shard_folder(0).read_rows().num_rows < 20 and not run.shard_folder(0).is_done()
    # once per process, and never in a requeued Slurm job's later runs: stopped() is not even asked
    asked: list[int] = []
    real_hold(lambda: asked.append(1) or False)
    monkeypatch.setattr(faults, "_held", False)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    real_hold(lambda: asked.append(1) or False)
    assert asked == []


class DyingEngine(FakeEngine):
    """Its core dies (a killed rank, the OOM killer) while the worker holds after its first part:
    `dead` turns true as vLLM's monitor would set it, and the next step raises."""

    dead = False

    def step(self) -> list[Completion]:
        if self.dead:
            raise RuntimeError("vLLM engine core died")
        return super().step()


def test_hold_ends_when_the_engine_dies(tmp_path: Path, monkeypatch) -> None:
    """A dead engine ends the hold as a stop signal does: the failure is counted at once, not after
    the hold's 60 s (the multi-node test kills a rank during it)."""
    from batchinfer import faults

    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 20)
    run = prepare(compose(fake_overrides(tmp_path, corpus, "output.commit_every_rows=4")))
    monkeypatch.setenv("BATCHINFER_HOLD", "60")
    monkeypatch.setattr(faults, "_held", False)
    eng = keyed(DyingEngine(), run)
    held = faults.hold

    def dies_while_held(stopped: Any) -> None:
        # The core dies once the worker holds (not at a set time, which a slow machine could pass
        # before the first part, the hold never entered).
        threading.Timer(0.5, lambda: setattr(eng, "dead", True)).start()
        held(stopped)

    monkeypatch.setattr(faults, "hold", dies_while_held)
    ended = hold_endings(monkeypatch)
    with pytest.raises(EngineFailure, match="engine core died"):
        run_shards(run, [0], engine=eng)
    assert ended == [True]  # the engine's death ended the hold, not its 60 s
    assert 0 < run.shard_folder(0).read_rows().num_rows < 20 and not run.shard_folder(0).is_done()
    progress = json.loads(run.shard_folder(0).progress_path.read_text())
    assert progress["failures"] == 1, progress
