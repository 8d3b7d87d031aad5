"""SIGKILL of a run on emulated NFS and Lustre locking (tests/support/fsemu), then resume: exactly once.
The subprocess runs the stand-in engine, held after its first part so that the kill lands on a
partial shard: the locks are what this proves."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
from support.filesystems import FSEMU, emulate
from support.procs import group_alive, kill_group
from support.runs import ROWS, Workload, committed_parts_are_whole, resume_and_check


@pytest.mark.engine
@pytest.mark.kill
@pytest.mark.parametrize("mode", ["nfs", "enosys", "enolck"])
def test_sigkill_then_resume_on_emulated_filesystems(
    standin_workload: Workload, mode: str, monkeypatch: pytest.MonkeyPatch, clean_shm: None, caplog: Any
) -> None:
    workload = standin_workload
    out = (workload.dir / f"flock-{mode}").resolve()
    env = dict(
        workload.env,
        PYTHONPATH=os.pathsep.join(p for p in (str(FSEMU), workload.env.get("PYTHONPATH", "")) if p),
        BATCHINFER_HOLD="300",  # after its first part, until the kill
        BATCHINFER_TEST_FLOCK=mode,
        # The whole run directory: the shard and merge locks, and datasets' cache lock while the
        # input is converted (which then goes to a node-local cache).
        BATCHINFER_TEST_FLOCK_ROOT=str(out),
    )
    log = workload.dir / f"flock-{mode}.log"
    cmd = [sys.executable, "-m", "batchinfer.cli", "run", *workload.base, f"output.dir={out}"]
    with open(log, "wb") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env, start_new_session=True)
        deadline = time.monotonic() + 300
        while not list(out.glob("shards/*/part-*")):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        kill_group(proc)
    assert proc.returncode == -signal.SIGKILL
    assert group_alive(proc.pid) == []
    assert 0 < committed_parts_are_whole(out) < ROWS
    fallback = "flock unsupported on this filesystem"
    assert (fallback in log.read_text()) == (mode != "nfs"), log.read_text()[-3000:]
    assert ("converting the input with a cache in" in log.read_text()) == (mode != "nfs")
    assert list(out.glob("shards/*/lock.excl")) if mode != "nfs" else not list(out.glob("shards/*/lock.excl"))

    emulate(monkeypatch, mode, env["BATCHINFER_TEST_FLOCK_ROOT"])  # the resume sees the same filesystem
    caplog.set_level("WARNING", logger="batchinfer")
    resume_and_check(workload, out)
    assert (fallback in caplog.text) == (mode != "nfs")
    assert not list(out.glob("shards/*/lock.excl*"))
