"""The engine's /dev/shm segments: what its processes held is removed once they are gone, and
only that: a segment a live process holds, or one another process left, stays."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from batchinfer.engine.shm import EngineSegments

# A segment whose process dies without unlinking it, and without a resource tracker to do it (as
# when vLLM's shutdown kills an engine process): its name on stdout, then it waits.
MAKER = """
import sys
from multiprocessing import resource_tracker, shared_memory
block = shared_memory.SharedMemory(create=True, size=4096)
resource_tracker.unregister(block._name, "shared_memory")
print(block.name, flush=True)
sys.stdin.read()
"""
# Another process's leftover: made by a process that is not this one's descendant, which exits.
STRANGER = """
import os
if os.fork():
    os._exit(0)
from multiprocessing import resource_tracker, shared_memory
block = shared_memory.SharedMemory(create=True, size=4096)
resource_tracker.unregister(block._name, "shared_memory")
print(block.name, flush=True)
"""


def started(code: str) -> tuple[subprocess.Popen, str]:
    """A python process running code, and the segment name it printed."""
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


def test_the_sweep_removes_what_the_engine_s_dead_processes_held_and_nothing_else() -> None:
    stranger = subprocess.run([sys.executable, "-c", STRANGER], capture_output=True, text=True, timeout=60)
    other = stranger.stdout.strip()
    dying, dead_name = started(MAKER)
    living, live_name = started(MAKER)
    try:
        segments = EngineSegments()
        segments.record()  # while the engine's processes run
        assert {dead_name, live_name} <= segments.names and other not in segments.names
        dying.send_signal(signal.SIGKILL)
        dying.wait(timeout=60)
        assert Path(f"/dev/shm/{dead_name}").exists()  # what the dead process left
        assert segments.sweep() == [dead_name]
        assert not Path(f"/dev/shm/{dead_name}").exists()
        assert Path(f"/dev/shm/{live_name}").exists() and Path(f"/dev/shm/{other}").exists()
    finally:
        living.communicate("", timeout=60)
        for name in (dead_name, live_name, other):
            if Path(f"/dev/shm/{name}").exists():
                os.unlink(f"/dev/shm/{name}")
