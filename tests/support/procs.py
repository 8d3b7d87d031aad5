"""batchinfer in a subprocess (its own process group), killing groups and vLLM's /dev/shm leftovers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from batchinfer.engine.shm import held_names


def run_cli(
    args: list[str], env: dict | None = None, timeout: float = 600, spy: Path | None = None, **kw: Any
) -> subprocess.CompletedProcess:
    """Run the batchinfer CLI in its own process group (its id is the result's `pid`); with spy,
    the rows it commits are logged there (COMMIT_SPY)."""
    full_env = dict(os.environ, **(env or {}))
    cmd = [sys.executable, "-m", "batchinfer.cli", *args]
    if spy is not None:
        cmd = [sys.executable, "-c", COMMIT_SPY, str(spy), *args]
    opts = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env, start_new_session=True)
    with subprocess.Popen(cmd, **opts, **kw) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            raise
    res = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    res.pid = proc.pid  # type: ignore[attr-defined]
    return res


def python_child(code: str, *args: str) -> subprocess.Popen:
    """`python -c code args...` with this test's import path, stdin/stdout/stderr piped as text: the
    second actor of a concurrency test (it says when it is where the test wants it on stdout)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def shm_entries() -> set[str]:
    """vLLM's shared-memory leftovers (psm_*, sem.mp-*)."""
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith(("psm_", "sem.mp-"))}
    except FileNotFoundError:
        return set()


def mapped_shm() -> set[str]:
    """The /dev/shm entries some live process has mapped (an engine's, of this test or of a test
    running beside it in another pytest-xdist worker): not leftovers, whoever made them. Matched
    by inode: glibc maps a named semaphore under a temporary name it then renames."""
    inodes: set[int] = set()
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/maps") as f:
                inodes.update(int(line.split()[4]) for line in f if " /dev/shm/" in line)
        except (OSError, IndexError, ValueError):
            continue
    names = set()
    for name in os.listdir("/dev/shm"):
        try:
            if os.stat(f"/dev/shm/{name}").st_ino in inodes:
                names.add(name)
        except OSError:
            continue
    return names


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL a process group started with start_new_session."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=60)


def group_alive(pgid: int, wait: float = 10.0) -> list[int]:
    """Pids of a process group still running (zombies awaiting a reaper do not count)."""
    deadline = time.monotonic() + wait
    while True:
        pids = []
        for d in os.listdir("/proc"):
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                pids.append(int(d))
        if not pids or time.monotonic() > deadline:
            return pids
        time.sleep(0.2)


# `batchinfer` in a subprocess with ShardFolder.write_part spied on: each committed part's rows are
# appended to argv[1] as a JSON line (what a resume redid, even after compaction removed its parts).
COMMIT_SPY = """
import json, sys
from batchinfer.rundir.shard_folder import ShardFolder
real = ShardFolder.write_part
def spy(self, table):
    path = real(self, table)
    with open(sys.argv[1], "a") as f:
        f.write(json.dumps(table.column("row").to_pylist()) + "\\n")
    return path
ShardFolder.write_part = spy
from batchinfer.cli import main
sys.exit(main(sys.argv[2:]))
"""


def spied_rows(log: Path) -> list[int]:
    """Rows a COMMIT_SPY subprocess committed."""
    return [r for line in log.read_text().splitlines() for r in json.loads(line)] if log.exists() else []


# `batchinfer` in a subprocess with one function blocked (argv[1] "module:name", "+" at its end to
# block after the call returns): it prints BLOCKED and waits for a line on stdin, "go" to carry on,
# "fail" to stop there with KeyboardInterrupt (a Ctrl-C at that moment).
BLOCKED = """
import importlib, sys
target, after = sys.argv[1].rstrip("+"), sys.argv[1].endswith("+")
module, name = target.rsplit(":", 1)
mod = importlib.import_module(module)
real = getattr(mod, name)
def wait():
    print("BLOCKED", flush=True)
    if sys.stdin.readline().strip() == "fail":
        raise KeyboardInterrupt
def blocked(*a, **k):
    if not after:
        wait()
    out = real(*a, **k)
    if after:
        wait()
    return out
setattr(mod, name, blocked)
from batchinfer.cli import main
sys.exit(main(sys.argv[2:]))
"""


class BlockedCli:
    """`batchinfer ARGS` in its own process group, stopped in the function `hook` names until
    `release`; `blocked()` returns once it is there (its output so far when it ended instead)."""

    def __init__(self, hook: str, args: list[str], env: dict | None = None):
        cmd = [sys.executable, "-c", BLOCKED, hook, *args]
        opts = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.proc = subprocess.Popen(cmd, **opts, env=dict(os.environ, **(env or {})), start_new_session=True)
        self.pid = self.proc.pid
        self.out: list[str] = []

    def blocked(self) -> None:
        """Wait until the process is in the hook; AssertionError with its stderr if it ended first."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.strip() == "BLOCKED":
                return
            self.out.append(line)
        raise AssertionError(f"ended before the hook: {''.join(self.out)}{self.proc.stderr.read()[-3000:]}")

    def release(self, how: str = "go", timeout: float = 600) -> subprocess.CompletedProcess:
        """Let it carry on ("go") or stop there ("fail"); its result once it ends."""
        try:
            out, err = self.proc.communicate(how + "\n", timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(self.proc)
            raise
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, "".join(self.out) + out, err)

    def __enter__(self) -> BlockedCli:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.proc.poll() is None:
            kill_group(self.proc)


class ShmWatch:
    """The /dev/shm segments a process group's processes hold, sampled while it runs."""

    def __init__(self, pgid: int):
        self.pgid, self.names, self.done = pgid, set(), threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.done.wait(0.5):
            self.names |= held_names(p.pid for p in psutil.process_iter() if _in_group(p, self.pgid))

    def stop(self) -> set[str]:
        """What was seen."""
        self.done.set()
        self.thread.join()
        return self.names


def _in_group(p: psutil.Process, pgid: int) -> bool:
    """Whether p is in process group pgid (False once it is gone)."""
    try:
        return os.getpgid(p.pid) == pgid
    except OSError:
        return False
