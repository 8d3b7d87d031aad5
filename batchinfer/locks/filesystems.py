"""flock as the filesystem under a run directory answers it: whether it works, whether it locks
only within one node (from the mount options), taking it through a descriptor, and the
filesystem's own clock (nodes' clocks differ)."""

from __future__ import annotations

import errno
import fcntl
import os
import uuid
from pathlib import Path
from typing import Optional

from batchinfer.mounts import Mount, mount_of, read_mounts

# flock errors that mean "this filesystem does not do flock" (EBADF only defensively: NFS's
# answer to a read-only descriptor is retried through a writable one, see flocked).
FLOCK_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EBADF}
MOUNTINFO = "/proc/self/mountinfo"


def read_text(path: str) -> Optional[str]:
    """A small text file's stripped content; None when it is empty or cannot be read."""
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def flock_works(folder: Path) -> bool:
    """Whether flock can lock a file in folder (not so on Lustre `noflock`, or NFS without a lock manager)."""
    probe = folder / f".flock-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in FLOCK_UNSUPPORTED:
            return False
        raise
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)


def _beegfs_global_locks(m: Mount) -> bool:
    """Whether a BeeGFS mount locks across clients (tuneUseGlobalFileLocks, false by default), from
    its mount options or the client config file the mount names (cfgFile=)."""
    settings: dict[str, str] = {}
    for opt in m.options:
        key, _, value = opt.partition("=")
        settings[key] = value
    if "tuneUseGlobalFileLocks" not in settings and settings.get("cfgFile"):
        text = read_text(settings["cfgFile"]) or ""
        for line in text.splitlines():
            key, _, value = line.split("#", 1)[0].partition("=")
            if key.strip() == "tuneUseGlobalFileLocks":
                settings["tuneUseGlobalFileLocks"] = value.strip()
    return settings.get("tuneUseGlobalFileLocks", "false").lower() in ("", "true", "1", "yes")


def node_local_flock(path: Path) -> Optional[str]:
    """Why flock on path's filesystem locks only within one node, or None (from mountinfo)."""
    m = mount_of(path, read_mounts(Path(MOUNTINFO)))
    if m is None:
        return None
    if m.fstype == "lustre" and "localflock" in m.options:
        return f"{m.point} is Lustre mounted localflock"
    if m.fstype in ("nfs", "nfs4"):
        for opt in ("local_lock=flock", "local_lock=all", "nolock"):
            if opt in m.options:
                return f"{m.point} is NFS mounted {opt}"
    if m.fstype == "beegfs" and not _beegfs_global_locks(m):
        return f"{m.point} is BeeGFS without tuneUseGlobalFileLocks"
    return None


def flocked(path: Path) -> int:
    """A descriptor of path holding an exclusive flock (BlockingIOError: held elsewhere).

    Read-only where that works, so a lock held for hours never blocks remounting the filesystem
    read-only; NFS emulates flock with POSIX locks, whose exclusive lock needs a descriptor open
    for writing (EBADF otherwise), so there it is taken again through a writable one (closing the
    read-only one drops nothing: this process holds no lock on the file, see lock.py's `_held`).
    A file its holder removed while we opened it is no lock any more: the name is opened again."""
    for _ in range(8):
        fd = _flocked_once(path)
        if _names(fd, path):
            return fd
        os.close(fd)  # its holder removed the file (and maybe its folder) meanwhile: lock the new one
    raise BlockingIOError(errno.EAGAIN, f"{path} kept being removed and made again")


def _flocked_once(path: Path) -> int:
    for flags in (os.O_RDONLY, os.O_RDWR):
        fd = os.open(path, flags | os.O_CREAT, 0o666)  # the umask decides
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except OSError as e:
            os.close(fd)
            if e.errno != errno.EBADF or flags == os.O_RDWR:
                raise
    raise AssertionError("unreachable")


def _names(fd: int, path: Path) -> bool:
    """Whether path still names the file open as fd (a lock on an unlinked file locks nothing)."""
    try:
        st, now = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino)


def writable(fd: int) -> bool:
    """Whether fd is open for writing."""
    return fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR)


def fs_now(folder: Path) -> float:
    """The filesystem's current time: the mtime of a file created now in folder (nodes' clocks differ)."""
    probe = folder / f"lock.clock-{uuid.uuid4().hex}"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        os.write(fd, b"x")  # some filesystems set mtime only at the first write
        return os.fstat(fd).st_mtime
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)


def fs_age(path: Path, st: os.stat_result) -> float:
    """Seconds since path was modified, by the filesystem's clock, not this node's."""
    return fs_now(path.parent) - st.st_mtime
