"""One engine of a task that runs several (cluster.engines_per_task): a worker process that asks
its task for shards one at a time and tells it how it ended.

Started by launch/engines.py as `python -m batchinfer.launch.member DIR INDEX OF FD_IN FD_OUT`:
it reads shard numbers from FD_IN and writes `next` and, last, `exit {json}` to FD_OUT (stdout
and stderr carry the engine's console output, so the protocol has descriptors of its own)."""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any, Optional

from batchinfer.inputs.read import Shard
from batchinfer.rundir.store import RunDir

log = logging.getLogger("batchinfer")
EXIT_DONE, EXIT_FAILED, EXIT_STOPPED = 0, 1, 3


class Member:
    """This process's link to its task: shards in, how it ended out."""

    def __init__(self, index: int, of: int, devices: str, fd_in: int, fd_out: int):
        self.index = index
        self.record = {"index": index, "of": of, "devices": devices}
        self._in = os.fdopen(fd_in, "r")
        self._out = os.fdopen(fd_out, "w", buffering=1)
        self.failure: dict[str, Any] = {}

    def shards(self, run: RunDir) -> Iterator[Shard]:
        """The shards the task hands this engine, one at a time, until it says `end`."""
        by_index = {s.index: s for s in run.shards()}
        while True:
            self._out.write("next\n")
            line = self._in.readline().strip()
            if not line or line == "end":
                return
            yield by_index[int(line)]

    def failed(self, shard: Optional[Shard], failures: Optional[int]) -> None:
        """Remember which shard failed and its failures in this submission (counted under its lock)."""
        self.failure = {"shard": shard.index if shard is not None else None, "failures": failures}

    def finish(self, outcome: dict[str, Any]) -> None:
        """Tell the task how this engine ended."""
        self._out.write("exit " + json.dumps(outcome) + "\n")
        self._out.close()


def devices_of_this_engine() -> str:
    """What this engine runs on (config.engines.engine_devices); pins this process to its cores."""
    from batchinfer.config.engines import engine_devices, parse_cpus

    devices = engine_devices()
    if devices.startswith("cpu:"):
        # The engine's other processes (its scheduler, tokenizing here) inherit this affinity, so
        # two engines on one node never share a core.
        os.sched_setaffinity(0, parse_cpus(devices[4:]))
    return devices


def main(argv: list[str]) -> int:
    """Run the shards the task hands out on one engine; report how it ended; exit status to match."""
    from batchinfer import security
    from batchinfer.engine.output import EngineOutput
    from batchinfer.engine.worker import Stopped
    from batchinfer.errors import BatchinferError
    from batchinfer.launch.local import _run_shards
    from batchinfer.logs import setup_logging

    run_dir, index, of, fd_in, fd_out = argv
    setup_logging()
    member = Member(int(index), int(of), devices_of_this_engine(), int(fd_in), int(fd_out))
    log.info("engine %s of %s on %s", index, of, member.record["devices"])
    run = RunDir(run_dir)
    try:
        with (
            security.private_umask(run.config.output.private),
            EngineOutput(run.logs_dir, enabled=True) as output,
        ):
            _run_shards(run, member.shards(run), None, output, member)
    except Stopped as e:
        member.finish({"status": "stopped", "signal": e.signum})
        return EXIT_STOPPED
    except BatchinferError as e:
        member.finish({"status": "error", "kind": type(e).__name__, "error": str(e)})
        return EXIT_FAILED
    except Exception as e:
        log.exception("engine %s failed", index)
        member.finish({"status": "failed", "error": f"{type(e).__name__}: {e}", **member.failure})
        return EXIT_FAILED
    member.finish({"status": "done"})
    return EXIT_DONE


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
