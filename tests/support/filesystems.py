"""Shared filesystems' locking, emulated: NFS (flock as POSIX record locks), Lustre (ENOSYS, node-local)."""

from __future__ import annotations

import fcntl
import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from support import TESTS

# A sitecustomize (on PYTHONPATH, for subprocesses) that emulates NFS and Lustre locking.
FSEMU = TESTS / "support" / "fsemu"
_spec = importlib.util.spec_from_file_location("fsemu_flock", FSEMU / "sitecustomize.py")
fsemu = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(fsemu)  # type: ignore[union-attr]
REAL_FLOCK = fcntl.flock


@dataclass
class Emulation:
    """The calls an emulated flock answered in this process: (mode, path, operation name)."""

    calls: list[tuple[str, str, str]] = field(default_factory=list)

    def paths(self) -> set[str]:
        """Every file the emulation locked or unlocked."""
        return {path for _, path, _ in self.calls}


def emulate(monkeypatch: pytest.MonkeyPatch, mode: str, root: Path | str = "") -> Emulation:
    """fcntl.flock answering as NFS / Lustre noflock / a host without a lock manager; the result
    records each call it answered, so a test can show the emulation was in force."""
    seen = Emulation()
    log = lambda m, path, op: seen.calls.append((m, path, fsemu.operation_name(op)))  # noqa: E731
    monkeypatch.setattr(fcntl, "flock", fsemu.emulated_flock(REAL_FLOCK, mode, str(root), log))
    return seen


def emulation_env(mode: str, root: Path | str, log: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a subprocess that loads the emulation for files under root, logging its
    calls to log."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("SLURM_")}
    # no Slurm job around the suite (CI inside a job) reaches the lock holders these processes judge
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(FSEMU), env.get("PYTHONPATH", "")) if p)
    env.update(BATCHINFER_TEST_FLOCK=mode, BATCHINFER_TEST_FLOCK_ROOT=str(root), BATCHINFER_TEST_FLOCK_LOG=str(log))
    return env


def logged_calls(log: Path) -> list[tuple[int, str, str, str]]:
    """A subprocess emulation's call log: (pid, mode, operation, path) per call; [] when it wrote none."""
    if not log.exists():
        return []
    out = []
    for line in log.read_text().splitlines():
        pid, mode, op, path = line.split(" ", 3)
        out.append((int(pid), mode, op, path))
    return out
