"""Shared filesystems' locking, emulated: NFS (flock as POSIX locks), Lustre (ENOSYS, node-local)."""

from __future__ import annotations

import fcntl
import importlib.util
from pathlib import Path

import pytest

from support import TESTS

# A sitecustomize (on PYTHONPATH, for subprocesses) that emulates NFS and Lustre locking.
FSEMU = TESTS / "support" / "fsemu"
_spec = importlib.util.spec_from_file_location("fsemu_flock", FSEMU / "sitecustomize.py")
fsemu = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(fsemu)  # type: ignore[union-attr]
REAL_FLOCK = fcntl.flock


def emulate(monkeypatch: pytest.MonkeyPatch, mode: str, root: Path | str = "") -> None:
    """fcntl.flock answering as NFS / Lustre noflock / a host without a lock manager."""
    monkeypatch.setattr(fcntl, "flock", fsemu.emulated_flock(REAL_FLOCK, mode, str(root)))
