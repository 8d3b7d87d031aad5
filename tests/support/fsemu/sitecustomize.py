"""Emulate a cluster filesystem's flock in a test subprocess (put this folder on PYTHONPATH).

BATCHINFER_TEST_FLOCK=nfs     flock as the Linux NFS client does it: a POSIX record lock on the
                              whole file (fcntl F_SETLK, taken here with the kernel's own POSIX
                              locks, so their semantics are real, not imitated): held per process
                              (a second descriptor in the same process is granted it too),
                              dropped when the process closes ANY descriptor of the file, not
                              held by children that inherit the descriptor, and an exclusive
                              lock through a descriptor not open for writing fails with EBADF
BATCHINFER_TEST_FLOCK=enosys  flock not implemented (Lustre mounted noflock)
BATCHINFER_TEST_FLOCK=enolck  no locks available (NFS without a lock manager)
BATCHINFER_TEST_FLOCK_ROOT    only files under these paths (os.pathsep-separated) are affected:
                              the run directory, as if it were on that filesystem
BATCHINFER_TEST_FLOCK_LOG     a file to which each emulated call appends one line
                              "<pid> <mode> <operation> <path>": the proof that the emulation was
                              loaded and applied to the files a test means
"""

from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Callable
from typing import Any

MODES = {"nfs", "enosys", "enolck"}


def operation_name(operation: int) -> str:
    """LOCK_EX|LOCK_NB and the like, for the call log."""
    names = [n for n in ("LOCK_SH", "LOCK_EX", "LOCK_UN") if operation & getattr(fcntl, n)]
    return "|".join(names + (["LOCK_NB"] if operation & fcntl.LOCK_NB else [])) or str(operation)


def posix_flock(fd: int, operation: int) -> None:
    """flock(fd, operation) carried out as a POSIX lock of the whole file, answering as flock does."""
    if operation & fcntl.LOCK_UN:
        kind = fcntl.LOCK_UN
    elif operation & fcntl.LOCK_EX:
        kind = fcntl.LOCK_EX
    else:
        kind = fcntl.LOCK_SH
    try:
        fcntl.lockf(fd, kind | (operation & fcntl.LOCK_NB))  # F_SETLK / F_SETLKW over the whole file
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EAGAIN):  # F_SETLK's "held elsewhere"; flock says EWOULDBLOCK
            raise BlockingIOError(errno.EWOULDBLOCK, os.strerror(errno.EWOULDBLOCK)) from None
        raise  # EBADF: an exclusive lock through a descriptor not open for writing


def emulated_flock(
    real: Callable[[Any, int], None], mode: str, root: str = "", log: Callable[[str, str, int], None] | None = None
) -> Callable[[Any, int], None]:
    """A flock that behaves as the named filesystem's does for files under root (prefixes); each
    emulated call is reported to log(mode, path, operation)."""
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
        if log is not None:
            log(mode, path, operation)
        if mode == "nfs":
            return posix_flock(fd, operation)
        code = errno.ENOSYS if mode == "enosys" else errno.ENOLCK
        raise OSError(code, os.strerror(code))

    return flock


def file_log(path: str) -> Callable[[str, str, int], None]:
    """A call log appending "<pid> <mode> <operation> <path>" lines to path (O_APPEND: whole lines
    from several processes)."""

    def log(mode: str, target: str, operation: int) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            os.write(fd, f"{os.getpid()} {mode} {operation_name(operation)} {target}\n".encode())
        finally:
            os.close(fd)

    return log


if os.environ.get("BATCHINFER_TEST_FLOCK"):
    fcntl.flock = emulated_flock(
        fcntl.flock,
        os.environ["BATCHINFER_TEST_FLOCK"],
        os.environ.get("BATCHINFER_TEST_FLOCK_ROOT", ""),
        file_log(os.environ["BATCHINFER_TEST_FLOCK_LOG"]) if os.environ.get("BATCHINFER_TEST_FLOCK_LOG") else None,
    )
