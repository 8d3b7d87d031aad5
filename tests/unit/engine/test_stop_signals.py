"""Stop signals are never lost (issue 27): the handler records a signal before anything else and logs
nothing (a log write inside it can fail as a reentrant write); a step of a hung engine core, which
waits on its output queue without a timeout, is woken when a stop is pending, so the worker commits
and the task requeues. No vLLM: the watchdog watches a queue like vLLM's sync client."""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from support.corpus import read_output
from support.fake_engine import FakeEngine, keyed, prepared

from batchinfer.engine import stopflag
from batchinfer.engine.stopflag import StopFlag
from batchinfer.engine.vllm_engine import Completion
from batchinfer.engine.watchdog import StepInterrupted, Watchdog
from batchinfer.errors import Stopped
from batchinfer.launch import slurm
from batchinfer.launch.local import run_shards
from batchinfer.rundir.merge import merge

# A hung core never answers; the tests' stand-in waits this long at most, so that without the
# wake-up a test fails instead of hanging. Not a threshold: the wake-up comes in about a second.
NEVER = 120


def _client() -> Any:
    """What the watchdog reads of vLLM's SyncMPClient: its resources and its output queue."""
    return SimpleNamespace(resources=SimpleNamespace(engine_dead=False), outputs_queue=queue.Queue())


def _vllm_step(client: Any) -> Any:
    """vLLM's step as far as the queue goes (SyncMPClient.get_output): wait, raise a queued exception."""
    try:
        out = client.outputs_queue.get(timeout=NEVER)
    except queue.Empty:  # a BaseException: no worker path takes it for a stop
        pytest.fail(f"the engine's step was not woken in {NEVER} s")
    if isinstance(out, Exception):
        raise out
    return out


def test_the_handler_records_a_signal_even_where_a_log_write_would_fail(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def reentrant(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("reentrant call inside <_io.BufferedWriter name='<stderr>'>")

    stop = StopFlag()
    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)}
    monkeypatch.setattr(stopflag.log, "warning", reentrant)
    try:
        stop.install()
        signal.raise_signal(signal.SIGUSR2)  # the handler runs in this thread, here
        stop._handle(signal.SIGTERM, None)  # the time limit's TERM after the preemption notice
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    assert stop.signum == signal.SIGUSR2 and stop.received == [signal.SIGUSR2, signal.SIGTERM]
    monkeypatch.undo()
    with caplog.at_level(logging.WARNING, logger="batchinfer"):
        stop.announce()
        stop.announce()  # each signal logged once
    assert caplog.messages == [
        "received SIGUSR2: committing and stopping",
        "received SIGTERM after SIGUSR2: SIGUSR2 decides how this task stops",
    ]


def test_a_hung_step_is_woken_when_a_stop_is_pending_and_only_then() -> None:
    client = _client()
    dog = Watchdog(client)
    stop = StopFlag()
    dog.wake_on(lambda: stop.signum is not None)

    def hung_step() -> Any:
        stop._handle(signal.SIGUSR2, None)  # the signal arrives while the step waits
        return _vllm_step(client)

    try:
        with pytest.raises(StepInterrupted, match="stop signal is pending"):
            dog.step(hung_step)
        # A wake-up left over from a step that returned by itself meanwhile is passed over by the
        # next worker's step on this reused engine (its stop flag is not set).
        client.outputs_queue.put(StepInterrupted("left over"))
        client.outputs_queue.put(["this step's output"])
        dog.wake_on(lambda: False)
        assert dog.step(lambda: _vllm_step(client)) == ["this step's output"]
        # A dead core wakes a step as before.
        client.resources.engine_dead = True
        with pytest.raises(RuntimeError, match="vLLM engine core died"):
            dog.step(lambda: _vllm_step(client))
    finally:
        dog.close()


class HangingEngine(FakeEngine):
    """The fake engine behind a watchdog: its `hang_at`-th step gets a USR2 (sent to this process)
    and then waits on its output queue, as vLLM's step does when its core hangs."""

    def __init__(self, hang_at: int):
        super().__init__(per_step=2)
        self.hang_at = hang_at
        self.client = _client()
        self.watchdog = Watchdog(self.client)
        self.wakes: list[Any] = []  # the stop flags it was told to wake on, in order
        self.sent: dict[str, list[int]] = {}
        self.answered: list[list[int]] = []  # token ids of the requests it answered

    def add(self, request_id: str, token_ids: list[int], params: Any) -> None:
        super().add(request_id, token_ids, params)
        self.sent[request_id] = token_ids

    def wake_on(self, stop_pending: Any) -> None:
        self.wakes.append(stop_pending)
        self.watchdog.wake_on(stop_pending)

    def step(self) -> list[Completion]:
        return self.watchdog.step(self._step)

    def _step(self) -> list[Completion]:
        if self.steps + 1 == self.hang_at:
            os.kill(os.getpid(), signal.SIGUSR2)  # the handler runs; the step goes on waiting
            _vllm_step(self.client)
        done = super().step()
        self.answered += [self.sent[c.request_id] for c in done]
        return done


def test_a_stop_during_a_hung_step_commits_what_finished_and_requeues(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = prepared(tmp_path, 30, "output.commit_every_rows=1000")
    rows = [json.loads(line) for line in (tmp_path / "c.jsonl").read_text().splitlines()]
    requeues: list[str] = []
    monkeypatch.setattr(slurm, "this_job", lambda: "77_0")
    monkeypatch.setattr(slurm, "requeue_task", lambda: requeues.append("requeue"))
    eng = keyed(HangingEngine(hang_at=4), run)
    try:
        with pytest.raises(Stopped, match="SIGUSR2"):
            run_shards(run, [0], engine=eng)
    finally:
        eng.watchdog.close()
    assert requeues == ["requeue"]
    # the stopped worker's flag woke the step; the engine is left with one that wakes nothing
    assert eng.wakes[0]() is True and eng.wakes[-1]() is False
    # the rows answered before the hang are committed (none was due: the stop committed them)
    committed = run.shard_folder(0).read_rows().to_pylist()
    assert len(committed) == 3 * eng.per_step == len(eng.answered)
    assert sorted(r["text"] for r in committed) == sorted(FakeEngine.answer(ids) for ids in eng.answered)
    progress = json.loads(run.shard_folder(0).progress_path.read_text())
    assert progress["rows_done"] == len(committed) and progress["suspects"] == {} and not run.shard_folder(0).is_done()
    run_shards(run, [0], engine=keyed(FakeEngine(), run))
    out = read_output(merge(run) and run.path)
    assert [r["row"] for r in out] == list(range(30))
    assert [r["text"] for r in out] == [FakeEngine.answer(eng.ids(x["text"])) for x in rows]


def test_the_supervisors_handler_records_and_passes_on_without_logging(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Item 18 for the task with several engines: its handler records the signal and passes it on
    to the members, and never writes a log line (a reentrant write would raise in the handler)."""
    from batchinfer.launch import engines

    def reentrant(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("reentrant call inside <_io.BufferedWriter name='<stderr>'>")

    passed: list[tuple[int, int]] = []

    class Member:  # what the handler reads of a running member
        class proc:
            pid, returncode = 4242, None

    stop = engines.TaskStop()
    stop.members = [Member()]  # type: ignore[list-item]
    monkeypatch.setattr(engines.os, "kill", lambda pid, signum: passed.append((pid, signum)))
    monkeypatch.setattr(engines.log, "warning", reentrant)
    saved = stop.install()
    try:
        signal.raise_signal(signal.SIGUSR2)  # the handler runs in this thread, here
        stop._handle(signal.SIGTERM, None)  # the time limit's TERM after the preemption notice
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    assert stop.signum == signal.SIGUSR2 and passed == [(4242, signal.SIGUSR2), (4242, signal.SIGTERM)]
    monkeypatch.undo()
    with caplog.at_level(logging.WARNING, logger="batchinfer"):
        stop.announce()
        stop.announce()  # logged once
    assert caplog.messages == ["received SIGUSR2: every engine commits and stops"]
