"""The engine's shared-memory segments in /dev/shm, removed when it stops.

vLLM's processes pass batches through POSIX shared memory (`psm_*`, Python's SharedMemory) and
multiprocessing semaphores (`sem.mp-*`). The process that made a segment unlinks it when it is
collected, but an engine process stopped by vLLM's shutdown (SIGTERM, then SIGKILL) never gets there,
and the file stays in /dev/shm, in RAM, with no process holding it. So the names the engine's
processes hold are recorded while they live (when the engine is ready and again before it is shut
down), and after the shutdown those that are still there and that no live process holds are removed.
Only recorded names are ever touched: another process's segments are not looked at.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path

import psutil

log = logging.getLogger("batchinfer")

SHM = Path("/dev/shm")
PREFIXES = ("psm_", "sem.mp-")  # Python's SharedMemory and multiprocessing's named semaphores


def _shm_paths(pid: int) -> set[str]:
    """/dev/shm paths a process maps or has open (empty when it is gone or not ours to read)."""
    paths: set[str] = set()
    try:
        with open(f"/proc/{pid}/maps") as f:
            paths.update(line.split(None, 5)[5].strip() for line in f if f" {SHM}/" in line)
        for fd in os.listdir(f"/proc/{pid}/fd"):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith(f"{SHM}/"):
                paths.add(target)
    except (OSError, IndexError):
        pass
    return {p for p in paths if not p.endswith(" (deleted)")}


def held_names(pids: Iterable[int]) -> set[str]:
    """Names of the /dev/shm segments (PREFIXES) the given processes map or have open."""
    names = {Path(p).name for pid in pids for p in _shm_paths(pid)}
    return {n for n in names if n.startswith(PREFIXES)}


def engine_pids() -> list[int]:
    """This process and its descendants: the engine's processes while it runs."""
    me = psutil.Process()
    try:
        return [me.pid, *(c.pid for c in me.children(recursive=True))]
    except psutil.Error:
        return [me.pid]


def _held_inodes() -> set[int]:
    """Inodes of the /dev/shm files some live process maps or has open."""
    inodes: set[int] = set()
    for pid in psutil.pids():
        for path in _shm_paths(pid):
            try:
                inodes.add(os.stat(path).st_ino)
            except OSError:
                pass
    return inodes


class EngineSegments:
    """The /dev/shm names an engine's processes held: recorded while they run, removed after."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def record(self) -> None:
        """Add the names this process and its descendants hold now."""
        self.names |= held_names(engine_pids())

    def sweep(self) -> list[str]:
        """Remove the recorded names that are still there and that no live process holds; returns them."""
        left = [n for n in sorted(self.names) if (SHM / n).exists()]
        if not left:
            return []
        held = _held_inodes()
        removed = []
        for name in left:
            try:
                if os.stat(SHM / name).st_ino in held:
                    continue
                os.unlink(SHM / name)
                removed.append(name)
            except FileNotFoundError:
                pass  # its maker removed it meanwhile
            except OSError as e:
                log.warning("cannot remove the engine's %s: %s", SHM / name, e.strerror)
        if removed:
            log.debug("removed %d shared-memory segment(s) the engine's processes left in %s", len(removed), SHM)
        self.names -= set(removed)
        return removed
