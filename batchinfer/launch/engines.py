"""A task with several engines (cluster.engines_per_task): one worker process per engine, each on
its own GPUs or cores, taking the task's shards one at a time; this process hands them out and
decides, once for the whole task, whether it stops, requeues or fails.

This process imports neither vllm nor torch: the members (launch/member.py) do."""

from __future__ import annotations

import logging
import os
import selectors
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

from batchinfer.config.engines import engine_devices, engine_envs, task_gpus
from batchinfer.errors import EngineFailure, RunDirError, Stopped
from batchinfer.inputs.shards import Shard
from batchinfer.launch import slurm
from batchinfer.launch.protocol import ExitRecord, LineReader, Message, Status, answer, decode, send
from batchinfer.launch.requeue import earns_another_attempt, requeue_for_another_attempt, requeue_on_stop
from batchinfer.locks import ShardLock, configured_mode
from batchinfer.rundir.progress import EngineSlot, count_failure
from batchinfer.rundir.store import RunDir
from batchinfer.stopsignals import STOP_SIGNALS

log = logging.getLogger("batchinfer")
PORTS_PER_ENGINE = 100  # VLLM_PORT, when set, is offset by this per engine
MEMBER = [sys.executable, "-m", "batchinfer.launch.member"]  # + DIR INDEX OF FD_IN FD_OUT
POLL_S = 1.0  # how often the task looks at its members' processes, whatever their pipes say
# A member that closed its pipe gets this long to exit before its process group is killed.
REAP_WAIT_S = 60.0


@dataclass
class MemberLink:
    """The task's end of the pipe to one member (the member holds the other end, member.TaskLink),
    with the member's process and what it said so far."""

    index: int
    devices: str
    proc: subprocess.Popen
    to_member: int  # raw descriptors: a dead reader leaves no buffered bytes to raise on close
    from_member: LineReader
    handed: Optional[int] = None  # the shard answered, not yet acknowledged (`took`)
    current: Optional[int] = None  # the shard it took and has not finished
    finished: list[int] = field(default_factory=list)
    outcome: Optional[ExitRecord] = None
    closed_at: Optional[float] = None  # when it closed its pipe (monotonic)
    reaped: bool = False  # it and its process group are gone

    def describe(self, of: int) -> str:
        """`engine 1 of 2 (devices 2,3)`."""
        return f"engine {self.index} of {of} (devices {self.devices})"


class TaskStop:
    """The first stop signal the task gets; each is passed on to the engines still running."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self.members: list[MemberLink] = []
        self._announced = False

    def install(self) -> dict[int, Any]:
        """Handlers for USR2, TERM and INT; returns the ones they replace."""
        saved = {s: signal.getsignal(s) for s in STOP_SIGNALS}
        for s in STOP_SIGNALS:
            signal.signal(s, self._handle)
        return saved

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            # Only recorded here: a log write from a handler that interrupted another write of the
            # same stream raises ("reentrant call"); announce() logs it from the serving loop.
            self.signum = signum
        # Slurm may signal only this process (plain sbatch, `scancel --batch`): pass it on. An
        # engine that got it already keeps the first signal's intent.
        for m in self.members:
            if m.proc.returncode is None:
                try:
                    os.kill(m.proc.pid, signum)
                except ProcessLookupError:
                    pass

    def announce(self) -> None:
        """Log the stop signal once, outside the handler."""
        if self.signum is not None and not self._announced:
            self._announced = True
            log.warning("received %s: every engine commits and stops", signal.Signals(self.signum).name)


def run_engines(run: RunDir, shards: list[Shard], n: int) -> None:
    """Finish shards with n engine processes; returns when all are done, else raises (after
    requeueing the task once if a stop signal or an engine failure calls for it)."""
    cfg = run.config
    gpus = task_gpus(cfg)
    envs = engine_envs(cfg, n, gpus, sorted(os.sched_getaffinity(0)))
    todo = deque(s.index for s in shards)
    stop = TaskStop()
    # Members start with USR2 blocked (they inherit the mask): Slurm's group-wide USR2 stays
    # pending in each until its own handler is in place, instead of killing it.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
    saved = stop.install()
    members: list[MemberLink] = []
    log.info("%d engines for shards %s: %s", n, [s.index for s in shards], "; ".join(_devices(e) for e in envs))
    try:
        for k, env in enumerate(envs):
            members.append(_start(run, k, n, env))
        stop.members = members
        # This process owns USR2 now (plain sbatch signals it alone, `B:USR2`): one sent so far
        # is delivered here and passed on to every member.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR2})
        if stop.signum is not None:  # TERM or INT before the list was complete
            stop._handle(stop.signum, None)
        _serve(members, todo, stop)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for s, h in saved.items():
            signal.signal(s, h)
        for m in members:  # _serve cut short (a bug, KeyboardInterrupt): no member outlives the task
            if m.closed_at is None:
                _close(m, todo)
            if not m.reaped:
                _reap(m, force=True)
    stop.announce()
    _decide(run, members, n, stop.signum, list(todo))


def _devices(env: dict[str, str]) -> str:
    if "CUDA_VISIBLE_DEVICES" in env:
        return f"GPUs {env['CUDA_VISIBLE_DEVICES']}"
    return f"cores {env['VLLM_CPU_OMP_THREADS_BIND']}"


def _start(run: RunDir, k: int, n: int, env: dict[str, str]) -> MemberLink:
    """Start engine k's worker process with its devices in its environment."""
    to_r, to_w = os.pipe()  # not inheritable: only pass_fds hands the member its two ends
    from_r, from_w = os.pipe()
    cmd = [*MEMBER, str(run.path), str(k), str(n), str(to_r), str(from_w)]
    # Its own process group: when it dies, what is left of its engine is killed with the group,
    # so a dead engine never holds its GPUs (or a shard's lock) while its siblings work on.
    full = {**os.environ, **env}
    if full.get("VLLM_PORT", "").isdigit():
        # vLLM scans upward from VLLM_PORT for free ports: engines starting together could pick the same
        full["VLLM_PORT"] = str(int(full["VLLM_PORT"]) + PORTS_PER_ENGINE * k)
    try:
        proc = subprocess.Popen(cmd, env=full, pass_fds=(to_r, from_w), process_group=0)
    except BaseException:
        for fd in (to_r, to_w, from_r, from_w):
            os.close(fd)
        raise
    os.close(to_r)
    os.close(from_w)
    os.set_blocking(from_r, False)  # read what is there; a member's silence never blocks the task
    return MemberLink(k, engine_devices(env), proc, to_w, LineReader(from_r))


def _serve(members: list[MemberLink], todo: deque[int], stop: TaskStop) -> None:
    """Hand out shards one at a time until every engine has exited, whatever each one does."""
    sel = selectors.DefaultSelector()
    for m in members:
        sel.register(m.from_member.fd, selectors.EVENT_READ, m)
    while not all(m.reaped for m in members):
        stop.announce()
        for key, _ in sel.select(timeout=POLL_S):
            m = key.data
            _read(m, todo, stop)
            if m.from_member.eof:  # it closed its end: it has exited, or is about to
                sel.unregister(m.from_member.fd)
                _close(m, todo)
        for m in members:
            if m.closed_at is None and m.proc.poll() is not None:
                # Killed alone, it leaves no end of file while a process it forked (vLLM's engine
                # core) still holds its pipe: its own exit is what counts.
                _read(m, todo, stop)  # its last words, if it wrote them
                sel.unregister(m.from_member.fd)
                _close(m, todo)
            if m.closed_at is not None and not m.reaped:
                # its siblings are served meanwhile; one that hangs after closing its pipe is killed
                _reap(m, force=time.monotonic() - m.closed_at >= REAP_WAIT_S)
    sel.close()


def _read(m: MemberLink, todo: deque[int], stop: TaskStop) -> None:
    """Act on what the member has said."""
    for line in m.from_member.read():
        said = decode(line)
        if said is None:
            log.warning("engine %d said %r, which is not a whole message: ignored", m.index, line[:200])
            continue
        message, arg = said
        if message is Message.NEXT:
            _hand_out(m, todo, stop)
        elif message is Message.TOOK and arg == m.handed:
            m.current, m.handed = m.handed, None
        elif message is Message.DONE and arg == m.current:
            m.finished.append(m.current)
            m.current = None
        elif message is Message.EXIT:
            assert isinstance(arg, ExitRecord)
            m.outcome = arg
        else:
            log.warning("engine %d said %r out of turn: ignored", m.index, line[:200])


def _hand_out(m: MemberLink, todo: deque[int], stop: TaskStop) -> None:
    """Answer `next`: the next shard (none once a stop signal came)."""
    shard = todo.popleft() if todo and stop.signum is None else None
    m.handed = shard
    if not send(m.to_member, answer(shard)):  # it died meanwhile: the shard was never started
        _give_back(m, todo)


def _give_back(m: MemberLink, todo: deque[int]) -> None:
    """A shard answered but never acknowledged goes back to the front of the queue."""
    if m.handed is not None:
        todo.appendleft(m.handed)
        m.handed = None


def _close(m: MemberLink, todo: deque[int]) -> None:
    """The member is done talking: close its pipe; a shard it did not acknowledge goes back."""
    m.closed_at = time.monotonic()
    for fd in (m.to_member, m.from_member.fd):
        try:
            os.close(fd)
        except OSError:
            pass
    _give_back(m, todo)


def _reap(m: MemberLink, force: bool) -> None:
    """Once the member has exited (or, with force, now), kill what is left of its process group
    (its engine) and judge a member that said nothing by how it ended."""
    hung = m.proc.poll() is None
    if hung and not force:
        return
    if hung:
        log.warning("engine %d closed its pipe but did not exit within %g s: killing it", m.index, REAP_WAIT_S)
    try:
        os.killpg(m.proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    rc = m.proc.wait()
    m.reaped = True
    if m.outcome is None:
        if hung:
            why = f"it hung after closing its pipe and was killed after {REAP_WAIT_S:g} s"
        else:
            why = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit status {rc} without a word"
        m.outcome = ExitRecord(Status.DIED, error=f"the engine's worker process died ({why})")


def _decide(run: RunDir, members: list[MemberLink], n: int, signum: Optional[int], left: list[int]) -> None:
    """One verdict for the task: finished, stopped (requeued on USR2), or failed (requeued while
    cluster.max_attempts allows). A stop signal decides first: what a member did after it (a config
    error, a failure) is said, and the task stops as the signal asks."""
    outcomes = {m.index: m.outcome or ExitRecord(Status.DIED, error="no outcome") for m in members}
    for m in members:
        log.info(
            "%s: %s; shards finished: %s",
            m.describe(n),
            outcomes[m.index].status.value,
            ", ".join(map(str, m.finished)) or "none",
        )
    stopped = [o.signal for o in outcomes.values() if o.status is Status.STOPPED and o.signal is not None]
    signum = signum if signum is not None else (stopped[0] if stopped else None)
    failed = [m for m in members if outcomes[m.index].status in (Status.FAILED, Status.DIED, Status.ERROR)]
    for m in failed:
        o = outcomes[m.index]
        if o.status is Status.DIED and m.current is not None:  # charged only to a shard it took
            o.shard, o.failures = m.current, _count_death(run, m, n, o)
    if not failed and signum is None:
        if left:  # cannot happen while one engine lives: every engine asks until it hears `end`
            raise EngineFailure(f"{run.path}: shards {left} were not handed to any engine; run the task again")
        return
    what = "; ".join(
        f"{m.describe(n)} failed"
        + (f" on shard {outcomes[m.index].shard}" if outcomes[m.index].shard is not None else "")
        + f": {outcomes[m.index].error}"
        for m in failed
    )
    done = sorted(s for m in members for s in m.finished)
    summary = f"{what}. Shards finished by this task: {', '.join(map(str, done)) or 'none'}; committed rows are safe"
    if signum is not None:
        if failed:
            log.error("%s", summary)
        requeue_on_stop(signum)
        raise Stopped(signum)
    config_errors = [outcomes[m.index] for m in failed if outcomes[m.index].status is Status.ERROR]
    if config_errors:
        raise config_errors[0].rebuilt_error(summary)  # another attempt would fail the same way
    if slurm.this_job():
        again = [
            earns_another_attempt(
                run,
                outcomes[m.index].shard if outcomes[m.index].shard is not None else -1,
                outcomes[m.index].failures,
                outcomes[m.index].error,
                f"{m.describe(n)}: ",
            )
            for m in failed
        ]
        if any(again):
            requeue_for_another_attempt()
    raise EngineFailure(f"{summary}. Run the same command (or `batchinfer resume`) to finish the rest")


def _count_death(run: RunDir, m: MemberLink, n: int, outcome: ExitRecord) -> Optional[int]:
    """A member that died without a word (SIGKILL, the OOM killer) counted nothing: count its
    shard's failed attempt here, under that shard's lock (free now that its group is gone)."""
    assert m.current is not None
    slot = EngineSlot(index=m.index, of=n, devices=m.devices)
    try:
        with ShardLock(run.shard_dir(m.current), mode=configured_mode(run.path), log=log.warning):
            return count_failure(
                run.shard_folder(m.current).progress_path, m.current, outcome.error or "died", engine=slot
            )
    except RunDirError as e:
        log.error("shard %d: could not count the failure of %s: %s", m.current, m.describe(n), e)
        return None
