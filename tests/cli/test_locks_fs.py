"""SIGKILL of a run on emulated NFS and Lustre locking (tests/support/fsemu), then resume: exactly once.
The subprocess runs the stand-in engine, held after its first part so that the kill lands on a
partial shard: the locks are what this proves. While it is held, another process is refused the
shard: on NFS (POSIX record locks, dropped when the holder closes any descriptor of the file) that
shows nothing the run did meanwhile let go of its lock. The emulation's call log proves it was
loaded, in the run and in the other process, and applied to the run directory's lock files."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from typing import Any

import pytest
from support.filesystems import emulate, emulation_env, logged_calls
from support.procs import group_alive, kill_group
from support.runs import ROWS, Workload, committed_parts_are_whole, resume_and_check

# Another process taking a shard's lock: prints "held" or the refusal.
TAKE = """\
import sys
from pathlib import Path
from batchinfer.errors import RunDirError
from batchinfer.locks import ShardLock
try:
    with ShardLock(Path(sys.argv[1]), mode="auto", log=lambda m: None):
        print("held")
except RunDirError as e:
    print(e)
"""


@pytest.fixture(autouse=True)
def _no_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lock judged is the run's own: a Slurm job around the suite (CI inside a job) must not
    leak in, and each mode's one-time log line must be logged again whatever ran before."""
    from batchinfer.locks import lock as lock_mod

    for var in (
        "SLURM_JOB_ID",
        "SLURM_ARRAY_JOB_ID",
        "SLURM_ARRAY_TASK_ID",
        "SLURM_RESTART_COUNT",
        "SLURM_CLUSTER_NAME",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(lock_mod, "_logged", set())


@pytest.mark.engine
@pytest.mark.kill
@pytest.mark.parametrize("mode", ["nfs", "enosys", "enolck"])
def test_sigkill_then_resume_on_emulated_filesystems(
    standin_workload: Workload, mode: str, monkeypatch: pytest.MonkeyPatch, clean_shm: None, caplog: Any
) -> None:
    workload = standin_workload
    out = (workload.dir / f"flock-{mode}").resolve()
    calls = workload.dir / f"flock-{mode}.calls"
    # The whole run directory: the shard and merge locks, and datasets' cache lock while the
    # input is converted (which then goes to a node-local cache).
    env = emulation_env(mode, out, calls, base=dict(workload.env, BATCHINFER_HOLD="300"))  # held after its first part
    log = workload.dir / f"flock-{mode}.log"
    cmd = [sys.executable, "-m", "batchinfer.cli", "run", *workload.base, f"output.dir={out}"]
    with open(log, "wb") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env, start_new_session=True)
        try:
            deadline = time.monotonic() + 300
            while not list(out.glob("shards/*/part-*")):
                assert proc.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline
                time.sleep(0.05)
            (shard,) = {p.parent for p in out.glob("shards/*/part-*")}
            other = subprocess.run(
                [sys.executable, "-c", TAKE, str(shard)], env=env, capture_output=True, text=True, timeout=120
            )
            assert proc.poll() is None, log.read_text()[-3000:]  # still holding when asked
        finally:
            kill_group(proc)
    assert f"{shard.name}: shard is being written by host" in other.stdout, other.stdout + other.stderr
    assert proc.returncode == -signal.SIGKILL
    assert group_alive(proc.pid) == []
    assert 0 < committed_parts_are_whole(out) < ROWS
    fallback = "flock unsupported on this filesystem"
    assert (fallback in log.read_text()) == (mode != "nfs"), log.read_text()[-3000:]
    assert ("converting the input with a cache in" in log.read_text()) == (mode != "nfs")
    assert list(out.glob("shards/*/lock.excl")) if mode != "nfs" else not list(out.glob("shards/*/lock.excl"))
    # The emulation answered in the run and in the other process, on the run directory's files.
    answered = logged_calls(calls)
    assert {m for _, m, _, _ in answered} == {mode} and all(path.startswith(str(out)) for *_, path in answered)
    assert len({pid for pid, _, _, path in answered if path == str(shard / "lock")}) >= 2

    seen = emulate(monkeypatch, mode, out)  # the resume sees the same filesystem
    caplog.set_level("WARNING", logger="batchinfer")
    resume_and_check(workload, out)
    assert (fallback in caplog.text) == (mode != "nfs")
    assert not list(out.glob("shards/*/lock.excl*"))
    assert str(shard / "lock") in seen.paths()
