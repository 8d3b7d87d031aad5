"""A task with several engines (cluster.engines_per_task): one worker process per engine, each on
its own GPUs or cores, taking the task's shards one at a time; this process hands them out and
decides, once for the whole task, whether it stops, requeues or fails.

This process imports neither vllm nor torch: the members (launch/member.py) do."""

from __future__ import annotations

import json
import logging
import os
import selectors
import signal
import subprocess
import sys
from collections import deque
from dataclasses import dataclass, field
from typing import IO, Any, Optional

from batchinfer import errors
from batchinfer.config.engines import engine_devices, engine_envs, task_gpus
from batchinfer.errors import BatchinferError, EngineFailure, RunDirError
from batchinfer.inputs.read import Shard
from batchinfer.launch import slurm
from batchinfer.rundir.locks import ShardLock
from batchinfer.rundir.store import RunDir

log = logging.getLogger("batchinfer")
STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)
PORTS_PER_ENGINE = 100  # VLLM_PORT, when set, is offset by this per engine
MEMBER = [sys.executable, "-m", "batchinfer.launch.member"]  # + DIR INDEX OF FD_IN FD_OUT


@dataclass
class MemberProcess:
    """One engine's worker process, seen from the task."""

    index: int
    devices: str
    proc: subprocess.Popen
    to_member: IO[str]
    from_member: IO[str]
    current: Optional[int] = None  # the shard it works on
    finished: list[int] = field(default_factory=list)
    outcome: Optional[dict[str, Any]] = None

    def describe(self, of: int) -> str:
        """`engine 1 of 2 (devices 2,3)`."""
        return f"engine {self.index} of {of} (devices {self.devices})"


class TaskStop:
    """The first stop signal the task gets; each is passed on to the engines still running."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self.members: list[MemberProcess] = []

    def install(self) -> dict[int, Any]:
        """Handlers for USR2, TERM and INT; returns the ones they replace."""
        saved = {s: signal.getsignal(s) for s in STOP_SIGNALS}
        for s in STOP_SIGNALS:
            signal.signal(s, self._handle)
        return saved

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            log.warning("received %s: every engine commits and stops", signal.Signals(signum).name)
            self.signum = signum
        # Slurm may signal only this process (plain sbatch, `scancel --batch`): pass it on. An
        # engine that got it already keeps the first signal's intent.
        for m in self.members:
            if m.proc.poll() is None:
                try:
                    os.kill(m.proc.pid, signum)
                except ProcessLookupError:
                    pass


def run_engines(run: RunDir, shards: list[Shard], n: int) -> None:
    """Finish shards with n engine processes; returns when all are done, else raises (after
    requeueing the task once if a stop signal or an engine failure calls for it)."""
    cfg = run.config
    gpus = task_gpus(cfg)
    envs = engine_envs(cfg, n, gpus, sorted(os.sched_getaffinity(0)))
    todo = deque(s.index for s in shards)
    stop = TaskStop()
    saved = stop.install()
    log.info("%d engines for shards %s: %s", n, [s.index for s in shards], "; ".join(_devices(e) for e in envs))
    try:
        members = [_start(run, k, n, env) for k, env in enumerate(envs)]
        stop.members = members
        if stop.signum is not None:  # a signal between the handlers and the list
            stop._handle(stop.signum, None)
        _serve(members, todo, stop)
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    _decide(run, members, n, stop.signum, list(todo))


def _devices(env: dict[str, str]) -> str:
    if "CUDA_VISIBLE_DEVICES" in env:
        return f"GPUs {env['CUDA_VISIBLE_DEVICES']}"
    return f"cores {env['VLLM_CPU_OMP_THREADS_BIND']}"


def _start(run: RunDir, k: int, n: int, env: dict[str, str]) -> MemberProcess:
    """Start engine k's worker process with its devices in its environment."""
    to_r, to_w = os.pipe()
    from_r, from_w = os.pipe()
    cmd = [*MEMBER, str(run.path), str(k), str(n), str(to_r), str(from_w)]
    # Its own process group: when it dies, what is left of its engine is killed with the group,
    # so a dead engine never holds its GPUs (or a shard's lock) while its siblings work on.
    full = {**os.environ, **env}
    if full.get("VLLM_PORT", "").isdigit():
        # vLLM scans upward from VLLM_PORT for free ports: engines starting together could pick the same
        full["VLLM_PORT"] = str(int(full["VLLM_PORT"]) + PORTS_PER_ENGINE * k)
    proc = subprocess.Popen(cmd, env=full, pass_fds=(to_r, from_w), process_group=0)
    os.close(to_r)
    os.close(from_w)
    return MemberProcess(k, engine_devices(env), proc, os.fdopen(to_w, "w", buffering=1), os.fdopen(from_r, "r"))


def _serve(members: list[MemberProcess], todo: deque[int], stop: TaskStop) -> None:
    """Hand out shards one at a time until every engine has exited."""
    sel = selectors.DefaultSelector()
    for m in members:
        sel.register(m.from_member, selectors.EVENT_READ, m)
    open_members = len(members)
    while open_members:
        for key, _ in sel.select(timeout=1.0):
            m: MemberProcess = key.data
            line = m.from_member.readline()
            if line.startswith("next"):
                if m.current is not None:
                    m.finished.append(m.current)
                m.current = todo.popleft() if todo and stop.signum is None else None
                _answer(m, "end" if m.current is None else str(m.current))
            elif line.startswith("exit "):
                m.outcome = json.loads(line[5:])
            elif not line:  # the member closed its end: it has exited, or is about to
                sel.unregister(m.from_member)
                m.from_member.close()
                m.to_member.close()
                open_members -= 1
                _reap(m)
    sel.close()


def _answer(m: MemberProcess, text: str) -> None:
    try:
        m.to_member.write(text + "\n")
    except BrokenPipeError:  # it died meanwhile: its EOF comes next
        pass


def _reap(m: MemberProcess) -> None:
    """Wait for a member to exit, then kill what is left of its process group (its engine)."""
    m.proc.wait()
    try:
        os.killpg(m.proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if m.outcome is not None and m.outcome.get("status") == "done":
        m.current = None
    rc = m.proc.returncode
    if m.outcome is None:
        why = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit status {rc} without a word"
        m.outcome = {"status": "died", "error": f"the engine's worker process died ({why})"}


def _decide(run: RunDir, members: list[MemberProcess], n: int, signum: Optional[int], left: list[int]) -> None:
    """One verdict for the task: finished, stopped (requeued on USR2), or failed (requeued while
    cluster.max_attempts allows)."""
    from batchinfer.engine.worker import Stopped
    from batchinfer.launch.local import _stopped, requeue_after_failure

    for m in members:
        o = m.outcome or {}
        log.info(
            "%s: %s; shards finished: %s", m.describe(n), o.get("status"), ", ".join(map(str, m.finished)) or "none"
        )
    stopped = [m.outcome["signal"] for m in members if m.outcome and m.outcome.get("status") == "stopped"]
    signum = signum if signum is not None else (stopped[0] if stopped else None)
    failed = [m for m in members if m.outcome and m.outcome.get("status") in ("failed", "died", "error")]
    for m in failed:
        if m.outcome["status"] == "died" and m.current is not None:
            m.outcome.update(shard=m.current, failures=_count_death(run, m, n))
    if signum is not None and not failed:
        _stopped(signum)
        raise Stopped(signum)
    if not failed:
        if left:  # cannot happen while one engine lives: every engine asks until it hears `end`
            raise EngineFailure(f"{run.path}: shards {left} were not handed to any engine; run the task again")
        return
    what = "; ".join(
        f"{m.describe(n)} failed"
        + (f" on shard {m.outcome['shard']}" if m.outcome.get("shard") is not None else "")
        + f": {m.outcome.get('error')}"
        for m in failed
    )
    done = sorted(s for m in members for s in m.finished)
    summary = f"{what}. Shards finished by this task: {', '.join(map(str, done)) or 'none'}; committed rows are safe"
    config_errors = [m for m in failed if m.outcome["status"] == "error"]
    if config_errors:
        raise _rebuilt(config_errors[0].outcome, summary)  # another attempt would fail the same way
    if signum is not None:
        log.error("%s", summary)
        _stopped(signum)
        raise Stopped(signum)
    if slurm.this_job():
        again = [
            requeue_after_failure(
                run, m.outcome.get("shard", -1), m.outcome.get("failures"), m.outcome.get("error"), f"{m.describe(n)}: "
            )
            for m in failed
        ]
        if any(again):
            slurm.requeue_self()
    raise EngineFailure(f"{summary}. Run the same command (or `batchinfer resume`) to finish the rest")


def _count_death(run: RunDir, m: MemberProcess, n: int) -> Optional[int]:
    """A member that died without a word (SIGKILL, the OOM killer) counted nothing: count its
    shard's failed attempt here, under that shard's lock (free now that its group is gone)."""
    from batchinfer.engine.worker import count_failure

    assert m.current is not None and m.outcome is not None
    engine = {"index": m.index, "of": n, "devices": m.devices}
    try:
        with ShardLock(run.shard_dir(m.current), log=log.warning):
            return count_failure(run, m.current, m.outcome["error"], engine=engine)
    except RunDirError as e:
        log.error("shard %d: could not count the failure of %s: %s", m.current, m.describe(n), e)
        return None


def _rebuilt(outcome: dict[str, Any], summary: str) -> BatchinferError:
    """The member's own error class (a config, input or storage error), with the task's summary."""
    cls = getattr(errors, str(outcome.get("kind")), None)
    message = f"{outcome.get('error')} ({summary})"
    if isinstance(cls, type) and issubclass(cls, BatchinferError):
        try:
            return cls(message)
        except TypeError:
            pass
    return BatchinferError(message)
