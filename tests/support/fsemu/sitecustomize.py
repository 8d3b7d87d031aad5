"""Emulate a cluster filesystem's flock in a test subprocess (put this folder on PYTHONPATH).

BATCHINFER_TEST_FLOCK=nfs     LOCK_EX through a descriptor not open for writing: EBADF (NFS
                              emulates flock with POSIX locks, which need write access)
BATCHINFER_TEST_FLOCK=enosys  flock not implemented (Lustre mounted noflock)
BATCHINFER_TEST_FLOCK=enolck  no locks available (NFS without a lock manager)
BATCHINFER_TEST_FLOCK_ROOT    only files under these paths (os.pathsep-separated) are affected:
                              the run directory, as if it were on that filesystem
"""

from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Callable
from typing import Any

MODES = {"nfs", "enosys", "enolck"}


def emulated_flock(real: Callable[[Any, int], None], mode: str, root: str = "") -> Callable[[Any, int], None]:
    """A flock that fails as the named filesystem's does, for files under root (prefixes)."""
    roots = tuple(r for r in root.split(os.pathsep) if r)
    if mode not in MODES:
        raise ValueError(f"BATCHINFER_TEST_FLOCK={mode!r}: one of {sorted(MODES)}")

    def flock(fd: Any, operation: int) -> None:
        fd = fd if isinstance(fd, int) else fd.fileno()
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            path = ""
        if roots and not path.startswith(roots):
            return real(fd, operation)
        if mode == "nfs":
            writable = (fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE) in (os.O_WRONLY, os.O_RDWR)
            if operation & fcntl.LOCK_EX and not writable:
                raise OSError(errno.EBADF, os.strerror(errno.EBADF))
            return real(fd, operation)
        code = errno.ENOSYS if mode == "enosys" else errno.ENOLCK
        raise OSError(code, os.strerror(code))

    return flock


if os.environ.get("BATCHINFER_TEST_FLOCK"):
    fcntl.flock = emulated_flock(
        fcntl.flock, os.environ["BATCHINFER_TEST_FLOCK"], os.environ.get("BATCHINFER_TEST_FLOCK_ROOT", "")
    )
