"""Who holds a lock: the holder record a lock file carries (host, pid and its start, boot, pid
namespace, Slurm job, cluster and restart count), this process's own, reading one from a lock
file, and the verdict a judge gives on it."""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path
from typing import Any, NamedTuple, Optional, TypedDict

from batchinfer import slurm_env
from batchinfer.locks.filesystems import read_text

BOOT_ID = "/proc/sys/kernel/random/boot_id"
PID_NAMESPACE = "/proc/self/ns/pid"


class Verdict(Enum):
    """Whether a lock's recorded holder may still write."""

    ALIVE = "alive"  # it may: refuse
    DEAD = "dead"  # provably gone: its lock is free
    UNKNOWN = "unknown"  # cannot be judged from here: refuse, never steal


class Judgement(NamedTuple):
    """A verdict on a holder and the reason, for logs and refusals."""

    verdict: Verdict
    why: str
    slurm_silent: bool = False  # UNKNOWN because Slurm did not answer: may pass by itself


def boot_id() -> Optional[str]:
    """This machine's current boot (None if unknown)."""
    return read_text(BOOT_ID)


def pid_namespace() -> Optional[str]:
    """This process's pid namespace (None if unknown): pids mean something only within it."""
    try:
        return os.readlink(PID_NAMESPACE)
    except OSError:
        return None


def pid_start(pid: int) -> Optional[int]:
    """When a process started, in clock ticks since boot (/proc/PID/stat field 22): with the pid
    and the boot it names one process, whatever the wall clock did; None if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return int(stat[stat.rindex(")") + 2 :].split()[19])  # counted after the (name)
    except (OSError, ValueError, IndexError):
        return None


class HolderRecord(TypedDict, total=False):
    """A holder as a lock file (and progress.json's `holder`) records it: Holder.record writes it,
    Holder.from_record reads it. Unset fields are left out; `slurm_job` is always there."""

    host: str
    pid: int
    slurm_job: Optional[str]
    since: float
    nonce: str
    slurm_restart: int
    slurm_cluster: str
    boot_id: str
    pid_ns: str
    pid_start: int
    released: bool
    released_at: float


@dataclass(frozen=True)
class Holder:
    """Who holds (or held) a lock: the record in a lock file."""

    host: Optional[str] = None
    pid: Optional[int] = None
    slurm_job: Optional[str] = None
    since: Optional[float] = None
    nonce: Optional[str] = None
    slurm_restart: Optional[int] = None  # the job's SLURM_RESTART_COUNT when it took the lock
    slurm_cluster: Optional[str] = None  # job ids are unique only within a cluster
    boot_id: Optional[str] = None  # with pid_ns: the pid means something on this machine only
    pid_ns: Optional[str] = None
    pid_start: Optional[int] = None  # with the pid: this process, not a later one given its pid
    released: bool = False
    released_at: Optional[float] = None

    @classmethod
    def mine(cls, nonce: Optional[str] = None) -> Holder:
        """This process, now."""
        env = slurm_env.current()
        return cls(
            host=socket.gethostname(),
            pid=os.getpid(),
            slurm_job=env.job,
            since=time.time(),
            nonce=nonce,
            slurm_restart=env.restart_count if env.job else None,
            slurm_cluster=env.cluster,
            boot_id=boot_id(),
            pid_ns=pid_namespace(),
            pid_start=pid_start(os.getpid()),
        )

    @classmethod
    def from_record(cls, record: Any) -> Optional[Holder]:
        """The holder a lock file's JSON names; None when it is not a record (values of the wrong
        type count as absent: a damaged field must not make a holder look like us)."""
        if not isinstance(record, dict) or not (record.get("host") or record.get("pid")):
            return None  # not a holder's record (an empty flock file reads as {})

        def text(key: str) -> Optional[str]:
            v = record.get(key)
            return str(v) if isinstance(v, (str, int)) and not isinstance(v, bool) and str(v) else None

        def number(key: str, kind: type) -> Any:
            v = record.get(key)
            return kind(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

        return cls(
            host=text("host"),
            pid=number("pid", int),
            slurm_job=text("slurm_job"),
            since=number("since", float),
            nonce=text("nonce"),
            slurm_restart=number("slurm_restart", int),
            slurm_cluster=text("slurm_cluster"),
            boot_id=text("boot_id"),
            pid_ns=text("pid_ns"),
            pid_start=number("pid_start", int),
            released=record.get("released") is True,
            released_at=number("released_at", float),
        )

    def record(self) -> HolderRecord:
        """The JSON record (keys of unset fields left out, released only when it is)."""
        out: HolderRecord = {k: v for k, v in asdict(self).items() if v is not None}  # type: ignore[assignment]
        if not self.released:
            out.pop("released")
        out["slurm_job"] = self.slurm_job  # always present: readers ask for it
        return out

    def describe(self) -> str:
        """Readable holder of a lock."""
        job = f", Slurm job {self.slurm_job}" if self.slurm_job else ""
        if job and self.slurm_cluster:
            job += f" on cluster {self.slurm_cluster}"
        return f"host {self.host} pid {self.pid}{job}"


def holder_info() -> HolderRecord:
    """Who this process is, as a lock records it (host, pid, Slurm job, ...)."""
    return Holder.mine().record()


def read_holder(path: Path) -> tuple[Optional[Holder], Optional[os.stat_result]]:
    """A lock file's holder (None: empty or unreadable) and its stat (None: absent). Never for a
    file this process may hold a POSIX lock on (closing would drop it): see lock.py's `_held`."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None, None
    except OSError:
        try:
            return None, os.stat(path)
        except OSError:
            return None, None
    try:
        st = os.fstat(fd)
        data = os.read(fd, 1 << 16)
    finally:
        os.close(fd)
    try:
        return Holder.from_record(json.loads(data)), st
    except ValueError:
        return None, st
