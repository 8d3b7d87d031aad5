"""One engine of a task that runs several (cluster.engines_per_task): a worker process that asks
its task for shards one at a time and tells it how it ended.

Started by launch/engines.py as `python -m batchinfer.launch.member DIR INDEX OF FD_IN FD_OUT`:
it speaks launch/protocol.py on FD_IN and FD_OUT (stdout and stderr carry the engine's console
output, so the protocol has descriptors of its own). Its engine starts before it asks for a
shard, so no shard lock is held while it starts, and no process it forks keeps the descriptors."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from typing import Optional

from batchinfer import security
from batchinfer.engine.output import EngineOutput
from batchinfer.errors import BatchinferError, Stopped
from batchinfer.inputs.shards import Shard
from batchinfer.launch.protocol import ExitRecord, LineReader, Message, Status, encode, parse_answer, send
from batchinfer.launch.shardloop import ShardLoop
from batchinfer.logs import setup_logging
from batchinfer.rundir.progress import EngineSlot
from batchinfer.rundir.store import RunDir

log = logging.getLogger("batchinfer")
EXIT_DONE, EXIT_FAILED, EXIT_STOPPED = 0, 1, 3


class TaskLink:
    """A member's end of the pipe to its task (the task holds the other end, engines.MemberLink):
    shards in, `took`/`done` and how this engine ended out."""

    def __init__(self, slot: EngineSlot, fd_in: int, fd_out: int):
        self.slot = slot
        self._in = LineReader(fd_in)
        self._out = fd_out
        for fd in (fd_in, fd_out):
            os.set_inheritable(fd, False)  # a process it starts (exec) never holds the task's pipe
        # vLLM forks its engine core (no exec): the fork must not keep the pipe either, or the task
        # would wait for an end of file that never comes once this process is killed alone.
        os.register_at_fork(after_in_child=self._close_in_child)

    def _close_in_child(self) -> None:
        for fd in (self._in.fd, self._out):
            try:
                os.close(fd)
            except OSError:
                pass

    def _answer(self) -> Optional[int]:
        """The task's answer to `next` (None: `end`, or the task is gone)."""
        while not self._in.eof:
            for line in self._in.read():  # one answer per `next`
                return parse_answer(line.decode(errors="replace")) if line.endswith(b"\n") else None
        return None

    def shards(self, run: RunDir) -> Iterator[Shard]:
        """The shards the task hands this engine, one at a time, until it says `end`; each is
        acknowledged when taken and when finished, so the task charges a death to the right one."""
        by_index = {s.index: s for s in run.shards()}
        while send(self._out, encode(Message.NEXT)):
            index = self._answer()
            if index is None or not send(self._out, encode(Message.TOOK, index)):
                return
            yield by_index[index]
            send(self._out, encode(Message.DONE, index))

    def finish(self, record: ExitRecord) -> None:
        """Tell the task how this engine ended."""
        send(self._out, encode(Message.EXIT, record))
        self._close_in_child()


def devices_of_this_engine() -> str:
    """What this engine runs on (config.engines.engine_devices); pins this process to its cores."""
    from batchinfer.config.engines import engine_devices, parse_cpus

    devices = engine_devices()
    if devices.startswith("cpu:"):
        # The engine's other processes (its scheduler, tokenizing here) inherit this affinity, so
        # two engines on one node never share a core.
        os.sched_setaffinity(0, parse_cpus(devices[4:]))
    return devices


def counted(loop: ShardLoop, shards: Iterator[Shard]) -> Iterator[Shard]:
    """The shards as the task hands them, each added to the bar as it comes."""
    for shard in shards:
        loop.count_in(shard)
        yield shard


def run_member(run: RunDir, link: TaskLink) -> ExitRecord:
    """Start the engine, then run the shards the task hands out until it says `end`; how it ended."""
    name = f"{run.path.name} engine {link.slot['index']}"
    loop: Optional[ShardLoop] = None
    try:
        with EngineOutput(run.logs_dir, enabled=True) as output, ShardLoop(run, None, output, name, link.slot) as loop:
            loop.start_engine()  # before it takes a shard: no shard lock is held while it starts
            loop.run(counted(loop, link.shards(run)))
    except Stopped as e:
        return ExitRecord(Status.STOPPED, signal=e.signum)
    except BatchinferError as e:
        return ExitRecord.for_error(e)
    except Exception as e:
        log.exception("engine %s failed", link.slot["index"])
        shard = loop.current.index if loop is not None and loop.current is not None else None
        failures = loop.failures if loop is not None else None
        return ExitRecord(Status.FAILED, error=f"{type(e).__name__}: {e}", shard=shard, failures=failures)
    return ExitRecord(Status.DONE)


EXIT_STATUS = {Status.DONE: EXIT_DONE, Status.STOPPED: EXIT_STOPPED}  # any other: EXIT_FAILED


def main(argv: list[str]) -> int:
    """Run the shards the task hands out on one engine; report how it ended; exit status to match."""
    run_dir, index, of, fd_in, fd_out = argv
    setup_logging()
    link = TaskLink(EngineSlot(index=int(index), of=int(of), devices=devices_of_this_engine()), int(fd_in), int(fd_out))
    log.info("engine %s of %s on %s", index, of, link.slot["devices"])
    run = RunDir(run_dir)
    with security.private_umask(run.config.output.private):
        record = run_member(run, link)
    link.finish(record)
    return EXIT_STATUS.get(record.status, EXIT_FAILED)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
