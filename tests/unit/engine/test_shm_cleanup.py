"""The kill tests' /dev/shm cleanup (conftest's clean_shm, support.procs.mapped_shm): it removes what
dead processes left and never what a live process maps, such as the engine of a test running beside
it in the other pytest-xdist worker (its semaphores mapped under glibc's temporary names)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

from support.procs import mapped_shm, shm_entries

HOLDER = """
import multiprocessing, sys
from multiprocessing import shared_memory
lock = multiprocessing.get_context("spawn").Lock()
block = shared_memory.SharedMemory(create=True, size=4096)
print("ready", flush=True)
sys.stdin.read()
block.close(); block.unlink()
"""


def test_a_live_process_entries_are_mapped_and_a_leftover_is_not() -> None:
    before = shm_entries()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    leftover = f"psm_leftover_{uuid.uuid4().hex[:8]}"
    try:
        assert holder.stdout.readline().strip() == "ready"
        live = shm_entries() - before
        assert any(n.startswith("sem.mp-") for n in live) and any(n.startswith("psm_") for n in live), live
        with open(f"/dev/shm/{leftover}", "wb") as f:  # what a SIGKILLed process leaves: nobody maps it
            f.write(b"x")
        mapped = mapped_shm()
        assert live <= mapped and leftover not in mapped
    finally:
        holder.communicate("", timeout=60)
        os.unlink(f"/dev/shm/{leftover}")
