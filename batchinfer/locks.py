"""Locks on a run directory: one writer per shard."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from batchinfer.errors import RunDirError
from batchinfer.store import refused_write, storage_error


def holder_info() -> dict[str, Any]:
    """Who holds a lock: host, pid, Slurm job id."""
    job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{job}_{os.environ.get('SLURM_ARRAY_TASK_ID')}" if job else os.environ.get("SLURM_JOB_ID")
    return {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job": job, "since": time.time()}


def describe_holder(info: dict[str, Any]) -> str:
    """Readable holder of a lock."""
    job = f", Slurm job {info['slurm_job']}" if info.get("slurm_job") else ""
    return f"host {info.get('host')} pid {info.get('pid')}{job}"


class ShardLock:
    """One writer per shard: an fcntl lock the kernel drops when the holder dies."""

    def __init__(self, shard_dir: Path, log: Callable[[str], None] = print):
        self.path = shard_dir / "lock"
        self.log = log
        self.fd: Optional[int] = None
        self.excl: Optional[Path] = None

    def __enter__(self) -> ShardLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Locked through a read-only descriptor (flock does not need write access): a writable
        # one held for hours would keep the filesystem from being remounted read-only.
        fd = os.open(self.path, os.O_RDONLY | os.O_CREAT, 0o666)  # the umask decides
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            info = _read_holder(self.path)
            os.close(fd)
            raise RunDirError(
                f"{self.path.parent.name}: shard is being written by {describe_holder(info)}; wait for it or cancel it"
            ) from None
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            self.log(f"flock unsupported on this filesystem ({e.strerror}); using an O_EXCL lock file")
            self._excl_lock()
            return self
        self.fd = fd
        try:
            with open(self.path, "w") as f:
                f.write(json.dumps(holder_info()))
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            self.__exit__()
            if refused_write(e) is None:
                raise
            raise storage_error(self.path, e) from None
        return self

    def _excl_lock(self) -> None:
        path = self.path.with_name("lock.excl")
        for _ in range(2):
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            except FileExistsError:
                info = _read_holder(path)
                if _holder_alive(info):
                    raise RunDirError(
                        f"{path.parent.name}: shard is being written by {describe_holder(info)}"
                    ) from None
                self.log(f"removing stale lock of {describe_holder(info)}")
                path.unlink(missing_ok=True)
                continue
            os.write(fd, json.dumps(holder_info()).encode())
            os.close(fd)
            self.excl = path
            return
        raise RunDirError(f"{path}: could not take the shard lock")

    def __exit__(self, *exc: Any) -> None:
        if self.fd is not None:
            os.close(self.fd)
        if self.excl is not None:
            self.excl.unlink(missing_ok=True)


def _read_holder(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}


def _holder_alive(info: dict[str, Any]) -> bool:
    """Judge an O_EXCL lock's holder: its Slurm job state, else its pid on this host."""
    if info.get("slurm_job"):
        import subprocess

        out = subprocess.run(["squeue", "-h", "-j", str(info["slurm_job"]), "-o", "%T"], capture_output=True, text=True)
        return out.returncode == 0 and out.stdout.strip() in ("RUNNING", "COMPLETING")
    if info.get("host") == socket.gethostname() and info.get("pid"):
        try:
            os.kill(int(info["pid"]), 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
    return True
