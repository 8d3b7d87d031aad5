"""Locks on a run directory: one writer per shard, one merge per run directory.

Two mechanisms, chosen per filesystem (`output.lock`: auto | flock | file):

flock
    Taken through a descriptor of `<lock>`. The kernel (or the filesystem's lock manager) drops
    it when the holder dies, so a dead holder's lock is free. On NFS, flock is emulated with POSIX
    record locks: per process (a second descriptor in the same process is granted it too),
    dropped when the process closes ANY descriptor of the file, not inherited by children, and an
    exclusive one needs a descriptor open for writing (EBADF otherwise). So a process never opens
    a lock file it may hold a second time (`_held` refuses a second lock of one name in one
    process before any open), and reads and writes its record through the locked descriptor.
    The file also holds the holder's record. Once flock is granted: a record naming a live
    holder on another node is refused (flock that is silently node-local); then our own record
    is published, then the lock file of the other mechanism is checked, then the record is
    re-read: another node that wrote its record over ours after we checked holds a node-local
    flock too, and we give way. A clean release writes a "released" record; the file is never
    unlinked (unlinking a flock file races with a process that has it open and locks it).

lock file (`<lock>.excl`)
    For filesystems where flock fails (Lustre `noflock`: ENOSYS; ENOLCK; EOPNOTSUPP) or only locks
    within one node (Lustre `localflock`, NFS `local_lock=flock|all`, `nolock`, BeeGFS without
    `tuneUseGlobalFileLocks`). Relies on what NFSv3+ and Lustre make atomic across nodes: `link`
    (and `O_EXCL` create) of a name that exists fails.

    - The holder record (`Holder`) is written to a temporary file, fsynced, then linked to
      `<lock>.excl`: the lock file is never empty. On NFS a retransmitted LINK can answer EEXIST
      although it succeeded; the temporary's link count (2) tells. Once linked, the flock
      record of the other mechanism is checked, then our lock file re-read.
    - An existing holder is judged (`judge_holder`) and its lock is free only when it is
      provably dead:
        * on this machine (same host name, boot and pid namespace) by its pid: no such process,
          or the pid now names another process (its start, in ticks since boot, differs);
        * a process of our own Slurm job (two processes of one salloc, `srun -n2`, members of
          one task) only by that, or by an earlier restart count than ours (Slurm ended that
          run before requeueing the job); a live one is never taken over;
        * another Slurm job by `squeue`, asked on the holder's cluster (`-M`) when that is not
          ours: alive states refuse, "Invalid job id" or no line = dead;
        * a holder Slurm did not answer for is refused and the lock kept, never stolen; a
          non-Slurm holder on another host cannot be judged and is refused.
      An empty or unreadable lock file is stale only when older than LOCK_UNREADABLE_STALE_S by
      the filesystem's clock (the mtime of a file created now).
    - Taking over a stale lock cannot succeed twice. The stale lock is identified by a key (its
      nonce, or inode and mtime for a record without one). A taker must first create
      `<lock>.excl.takeover-<key>-<g>` by link, which only one process can do; it then re-reads
      `<lock>.excl`, and only if that still carries the key does it `os.replace` its own record
      over it. Every other writer of `<lock>.excl` is excluded at that moment: the stale holder
      is dead, a fresh creator's link fails while the name exists, a release unlinks only its own
      nonce, and any other taker of the same key needs the same marker name. A taker that dies
      holding the marker leaves it to be judged like a lock (a live taker of our own job
      included); once its holder is judged dead the next generation `<g+1>` is claimed, again by
      one process only. After the replace the key is gone from `<lock>.excl`, so a late taker's
      re-read fails and it gives up. Release unlinks `<lock>.excl` only while it still carries
      our nonce; since only a provably dead holder's lock is ever replaced, nobody replaces a
      live holder's lock between its release's read and its unlink.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Any, NamedTuple, Optional

from batchinfer import slurm_env
from batchinfer.errors import RunDirError, TransientRunDirError
from batchinfer.mounts import Mount, mount_of, read_mounts
from batchinfer.rundir.store import fsync_dir, refused_write, storage_error

LOCK_MODES = ("auto", "flock", "file")
# An empty or unreadable lock file older than this (filesystem clock) is stale: its writer was
# killed between create and write (an older batchinfer) or the file was damaged.
LOCK_UNREADABLE_STALE_S = 300.0
# squeue is asked with this timeout; no answer in time = the holder cannot be judged.
SQUEUE_TIMEOUT_S = 30.0
# Slurm states in which a job's processes may still run and write.
SLURM_ALIVE = {"RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "STOPPED", "SIGNALING", "RESIZING"}
# flock errors that mean "this filesystem does not do flock" (EBADF only defensively: NFS's
# answer to a read-only descriptor is retried through a writable one, see _flocked).
FLOCK_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EBADF}
MOUNTINFO = "/proc/self/mountinfo"
BOOT_ID = "/proc/sys/kernel/random/boot_id"
PID_NAMESPACE = "/proc/self/ns/pid"
# A run.yaml that cannot be read is read again after these waits (seconds) before the lock is
# refused: its output.lock decides the mechanism, and guessing "auto" could mix two.
RUN_YAML_RETRY_WAITS = (0.5, 2.0)
_TAKEOVER_GENERATIONS = 32
_logged: set[str] = set()
# The locks this process holds, by (pid, path): a second lock of one name in one process is
# refused before the file is opened (POSIX locks are per process, and closing a second
# descriptor would drop the first one's lock).
_held: set[tuple[int, str]] = set()
_held_guard = threading.Lock()


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


def _read_text(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def _pid_namespace() -> Optional[str]:
    try:
        return os.readlink(PID_NAMESPACE)
    except OSError:
        return None


def _pid_start(pid: int) -> Optional[int]:
    """When a process started, in clock ticks since boot (/proc/PID/stat field 22): with the pid
    and the boot it names one process, whatever the wall clock did; None if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return int(stat[stat.rindex(")") + 2 :].split()[19])  # counted after the (name)
    except (OSError, ValueError, IndexError):
        return None


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
            boot_id=_read_text(BOOT_ID),
            pid_ns=_pid_namespace(),
            pid_start=_pid_start(os.getpid()),
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

    def record(self) -> dict[str, Any]:
        """The JSON record (keys of unset fields left out, released only when it is)."""
        out = {k: v for k, v in asdict(self).items() if v is not None}
        if not self.released:
            out.pop("released")
        return dict(out, slurm_job=self.slurm_job)  # always present: readers ask for it

    def describe(self) -> str:
        """Readable holder of a lock."""
        job = f", Slurm job {self.slurm_job}" if self.slurm_job else ""
        if job and self.slurm_cluster:
            job += f" on cluster {self.slurm_cluster}"
        return f"host {self.host} pid {self.pid}{job}"


def holder_info() -> dict[str, Any]:
    """Who this process is, as a lock records it (host, pid, Slurm job, ...)."""
    return Holder.mine().record()


def _log_once(log: Callable[[str], None], message: str) -> None:
    """Say a filesystem fact once per process, not at every shard."""
    if message not in _logged:
        _logged.add(message)
        log(message)


# ---------------------------------------------------------------- judging a holder


def _default_cluster(timeout: float) -> Optional[str]:
    """The cluster Slurm's commands ask by default here (outside a job), or None if unknown."""
    try:
        out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "ClusterName":
            return value.strip() or None
    return None


def _squeue_state(job: str, timeout: float, cluster: Optional[str] = None) -> Judgement:
    """Judge a Slurm job by squeue (on the given cluster with -M, else the default one)."""
    where = ["-M", cluster] if cluster else []
    try:
        out = subprocess.run(
            ["squeue", *where, "-h", "-j", str(job), "-o", "%T"], capture_output=True, text=True, timeout=timeout
        )
    except FileNotFoundError:
        return Judgement(Verdict.UNKNOWN, "squeue is not installed here", True)
    except subprocess.TimeoutExpired:
        return Judgement(Verdict.UNKNOWN, f"squeue did not answer within {timeout:g} s", True)
    except OSError as e:
        return Judgement(Verdict.UNKNOWN, f"squeue could not run ({e})", True)
    on = f" on cluster {cluster}" if cluster else ""
    if "Invalid job id" in out.stderr:
        return Judgement(Verdict.DEAD, f"Slurm{on} no longer knows the job")  # purged after MinJobAge
    if out.returncode != 0:
        failed = (out.stderr.strip() or f"exit {out.returncode}")[:200]
        return Judgement(Verdict.UNKNOWN, f"squeue{on} failed: {failed}", True)
    # With -M, squeue may head its answer with "CLUSTER: name".
    states = [s for s in out.stdout.split() if s != "CLUSTER:" and s != cluster]
    if not states:
        return Judgement(Verdict.DEAD, f"the job is no longer queued{on}")
    alive = [s for s in states if s in SLURM_ALIVE]
    return (
        Judgement(Verdict.ALIVE, f"Slurm{on}: {alive[0]}")
        if alive
        else Judgement(Verdict.DEAD, f"Slurm{on}: {states[0]}")
    )


def _slurm_state(holder: Holder, me: slurm_env.SlurmEnv) -> Judgement:
    """Judge another Slurm job's holder, asking the cluster it ran on: job ids are per cluster,
    and the default cluster answers "Invalid job id" for a live job of another one."""
    assert holder.slurm_job is not None
    cluster = holder.slurm_cluster
    if cluster and cluster != (me.cluster or _default_cluster(SQUEUE_TIMEOUT_S)):
        return _squeue_state(holder.slurm_job, SQUEUE_TIMEOUT_S, cluster)
    return _squeue_state(holder.slurm_job, SQUEUE_TIMEOUT_S)


def _same_machine(holder: Holder) -> bool:
    """Whether the holder ran on this machine, in this boot (the same host name on two machines
    happens with containers; a different boot id is then another machine, or a reboot)."""
    if holder.host != socket.gethostname():
        return False
    boot = _read_text(BOOT_ID)
    return holder.boot_id is None or boot is None or holder.boot_id == boot


def _judge_locally(holder: Holder) -> Optional[Judgement]:
    """The holder judged by its pid when it ran on this machine in this pid namespace; None when
    its pid means nothing here."""
    if not holder.pid or not _same_machine(holder):
        return None
    if holder.pid_ns is None:
        if holder.slurm_job:
            return None  # an older batchinfer's record: judged by Slurm, as that version did
    elif holder.pid_ns != _pid_namespace():
        return None  # another container's pids
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return Judgement(Verdict.DEAD, "no such process")
    except PermissionError:
        pass  # someone else's live process
    started = _pid_start(holder.pid)
    if holder.pid_start is not None and started is not None and started != holder.pid_start:
        return Judgement(Verdict.DEAD, f"pid {holder.pid} is now another process, started after the holder")
    return Judgement(Verdict.ALIVE, "process running")


def _same_job(holder: Holder, me: slurm_env.SlurmEnv) -> bool:
    if not holder.slurm_job or holder.slurm_job != me.job:
        return False
    return not (holder.slurm_cluster and me.cluster and holder.slurm_cluster != me.cluster)


def _judge_own_job(holder: Holder, me: slurm_env.SlurmEnv) -> Judgement:
    """A holder of our own Slurm job on another machine: alive (Slurm shows our job running)
    unless its run is an earlier one than ours."""
    if holder.slurm_restart is None:
        return Judgement(
            Verdict.UNKNOWN,
            "a process of this same Slurm job; its record, from an older batchinfer, has no restart count",
        )
    if holder.slurm_restart < me.restart_count:
        return Judgement(
            Verdict.DEAD,
            f"an earlier run of this Slurm job (restart {holder.slurm_restart}, this is restart "
            f"{me.restart_count}): Slurm ended it before requeueing",
        )
    return Judgement(Verdict.ALIVE, f"a live process of this same Slurm job and run (restart {holder.slurm_restart})")


def judge_holder(holder: Holder) -> Judgement:
    """Whether a lock's recorded holder may still write; a lock is free only when it is DEAD."""
    local = _judge_locally(holder)
    if local is not None:
        return local
    me = slurm_env.current()
    if _same_job(holder, me):
        return _judge_own_job(holder, me)
    if holder.slurm_job:
        return _slurm_state(holder, me)
    return Judgement(Verdict.UNKNOWN, "on another host without a Slurm job")


def _refusal(
    refuse: Callable[[str], RunDirError], holder: Holder, judged: Judgement, path: Path, note: str = ""
) -> RunDirError:
    """The refusal that keeps a holder's lock (verdict ALIVE or UNKNOWN)."""
    who = holder.describe() + note
    if judged.verdict is Verdict.ALIVE:
        return refuse(f"{who} ({judged.why})")
    if judged.slurm_silent:
        e = refuse(f"{who}; Slurm did not answer ({judged.why}), so the lock is kept, never stolen: try again later")
        return TransientRunDirError(*e.args)  # retried by the shard loop
    return refuse(
        f"{who} ({judged.why}: it cannot be checked from here); if that process is gone, remove {path} by hand"
    )


# ---------------------------------------------------------------- filesystems


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
        text = _read_text(settings["cfgFile"]) or ""
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


def _read(path: Path) -> tuple[Optional[Holder], Optional[os.stat_result]]:
    """A lock file's holder (None: empty or unreadable) and its stat (None: absent). Never for a
    file this process may hold a POSIX lock on (closing would drop it): see `_held`."""
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


def _flocked(path: Path) -> int:
    """A descriptor of path holding an exclusive flock (BlockingIOError: held elsewhere).

    Read-only where that works, so a lock held for hours never blocks remounting the filesystem
    read-only; NFS emulates flock with POSIX locks, whose exclusive lock needs a descriptor open
    for writing (EBADF otherwise), so there it is taken again through a writable one (closing the
    read-only one drops nothing: this process holds no lock on the file, see `_held`)."""
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


def _writable(fd: int) -> bool:
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


# ---------------------------------------------------------------- the lock-file mechanism


class _ExclFile:
    """The lock-file mechanism on one name (see the module docstring)."""

    def __init__(self, path: Path, refuse: Callable[[str], RunDirError], log: Callable[[str], None]):
        self.path = path
        self.refuse = refuse
        self.log = log
        self.nonce = uuid.uuid4().hex
        self.record = Holder.mine(self.nonce).record()

    def acquire(self) -> None:
        """Take the lock or raise the refusal naming its holder."""
        for _ in range(8):
            if self._create(self.path, self.record):
                self._clean_leftovers()
                return
            holder, st = _read(self.path)
            if st is None:
                continue  # released meanwhile
            key = _key(holder, st)
            if holder is None:
                age = fs_age(self.path, st)
                if age < LOCK_UNREADABLE_STALE_S:
                    raise self.refuse(
                        f"an unknown holder (the lock file {self.path} is empty or unreadable, {age:.0f} s old; "
                        f"it counts as stale after {LOCK_UNREADABLE_STALE_S:g} s)"
                    )
                why = f"an empty or unreadable lock file {age:.0f} s old"
            else:
                why = self._judge_or_refuse(holder, self.path)
            self.log(f"{self.path}: taking over the stale lock of {why}")
            if self.takeover(key):
                self._clean_leftovers()
                return
        raise self.refuse(f"others (the lock file {self.path} kept changing; try again)")

    def _judge_or_refuse(self, holder: Holder, path: Path) -> str:
        """Describe a holder that is provably gone, or raise the refusal that keeps its lock."""
        judged = judge_holder(holder)
        if judged.verdict is not Verdict.DEAD:
            raise _refusal(self.refuse, holder, judged, path)
        return f"{holder.describe()} ({judged.why})"

    def takeover(self, key: str) -> bool:
        """Replace the stale lock identified by key with ours; False when it changed meanwhile."""
        for g in range(1, _TAKEOVER_GENERATIONS + 1):
            marker = self.path.with_name(f"{self.path.name}.takeover-{key}-{g}")
            if self._create(marker, self.record):
                break
            holder, st = _read(marker)
            if st is None:
                return False  # its taker finished and removed it: re-read the lock
            if holder is None:
                if fs_age(marker, st) < LOCK_UNREADABLE_STALE_S:
                    raise self.refuse(f"another process taking the stale lock over ({marker})")
            elif holder.nonce != self.nonce:
                self._judge_or_refuse(holder, marker)  # a live taker keeps it; a dead one: next generation
        else:
            raise self.refuse(f"others (too many takeovers of {self.path} died half way; remove it by hand)")
        try:
            _after_claim()
            holder, st = _read(self.path)
            if st is None or _key(holder, st) != key:
                return False  # released or taken over by someone else: start again
            tmp = self._write_temp(self.record)
            os.replace(tmp, self.path)
            fsync_dir(self.path.parent)
            return True
        finally:
            marker.unlink(missing_ok=True)

    def holds(self) -> bool:
        """Whether the lock file still carries our record."""
        holder, _ = _read(self.path)
        return holder is not None and holder.nonce == self.nonce

    def _clean_leftovers(self) -> None:
        """Remove what killed contenders left (temporaries, probes, dead takers' markers): only
        files older than LOCK_UNREADABLE_STALE_S, so a live contender's files stay."""
        prefix = self.path.name + "."
        old = []
        for p in self.path.parent.iterdir():
            rest = p.name[len(prefix) :] if p.name.startswith(prefix) else ""
            if rest.startswith(("new-", "takeover-")) and not p.is_symlink():
                try:
                    old.append((p, os.stat(p)))
                except OSError:
                    pass
        if not old:
            return
        try:
            now = fs_now(self.path.parent)
            for p, st in old:
                if now - st.st_mtime >= LOCK_UNREADABLE_STALE_S:
                    p.unlink(missing_ok=True)
        except OSError:
            pass  # best effort: leftovers only cost a directory entry

    def _write_temp(self, record: dict[str, Any]) -> Path:
        """Our record in a fresh, fsynced file beside the lock (not named `.tmp-*`: the shard
        writer's clean-up of its own temporaries must not remove it)."""
        tmp = self.path.with_name(f"{self.path.name}.new-{uuid.uuid4().hex}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            os.write(fd, json.dumps(record).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        return tmp

    def _create(self, name: Path, record: dict[str, Any]) -> bool:
        """Publish record under name if the name does not exist; never leaves it empty."""
        tmp = self._write_temp(record)
        try:
            os.link(tmp, name)
        except FileExistsError:
            # An NFS LINK retransmitted after a lost reply answers EEXIST although it linked.
            if os.stat(tmp).st_nlink != 2:
                return False
        finally:
            tmp.unlink(missing_ok=True)
        fsync_dir(name.parent)
        return True

    def release(self) -> None:
        """Remove the lock if it is still ours."""
        if self.holds():
            self.path.unlink(missing_ok=True)


def _key(holder: Optional[Holder], st: os.stat_result) -> str:
    """What identifies one holder's lock file: its nonce, else the file itself."""
    nonce = holder.nonce if holder else None
    return str(nonce) if nonce else f"i{st.st_ino}.{st.st_mtime_ns}"


def _after_claim() -> None:
    """Between claiming a takeover and re-reading the lock (tests interleave a second taker here)."""


def _after_publish() -> None:
    """Between publishing our record and checking the other mechanism (tests interleave here)."""


# ---------------------------------------------------------------- the mode


def configured_mode(run_dir: Path) -> str:
    """output.lock from DIR/run.yaml: "auto" only when there is no run.yaml (older run directories)
    or it names none. A run.yaml that cannot be read or parsed now is read again, then refused:
    guessing "auto" would take flock beside tasks that use lock files."""
    import yaml

    path = run_dir / "run.yaml"
    problem = ""
    for wait in (*RUN_YAML_RETRY_WAITS, None):
        try:
            run = yaml.safe_load(path.read_text())
            if run is None or isinstance(run, dict):
                break
            problem = "it is not a mapping"
        except FileNotFoundError:
            return "auto"
        except OSError as e:
            problem = f"it cannot be read: {e.strerror or e}"
        except yaml.YAMLError as e:
            problem = f"it is not valid YAML: {str(e).splitlines()[0]}"
        if wait is None:
            raise TransientRunDirError(  # an NFS hiccup passes: the shard loop retries
                f"{path}: {problem}. Its output.lock decides how shards are locked, so nothing is "
                "written; check the file (and the filesystem) and run again"
            )
        time.sleep(wait)
    mode = (((run or {}).get("config") or {}).get("output") or {}).get("lock") or "auto"
    return str(mode)


# ---------------------------------------------------------------- the lock


class FileLock:
    """One holder of a named lock in a run directory: flock where it works, else a lock file."""

    def __init__(
        self,
        path: Path,
        busy: Callable[[str], str],
        log: Callable[[str], None] = print,
        mode: Optional[str] = None,
    ):
        self.path = path
        self.busy = busy  # holder description -> refusal message
        self.log = log
        self.mode = mode
        self.fd: Optional[int] = None
        self.nonce: Optional[str] = None  # of our record in the flock file
        self.excl: Optional[_ExclFile] = None
        self._held_key: Optional[tuple[int, str]] = None

    def _refuse(self, holder: str) -> RunDirError:
        return RunDirError(self.busy(holder))

    def _default_mode(self) -> str:
        return "auto"

    def __enter__(self) -> FileLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        mode = self.mode or self._default_mode()
        if mode not in LOCK_MODES:
            raise RunDirError(f"output.lock={mode!r} is not one of: {', '.join(LOCK_MODES)}")
        key = (os.getpid(), os.path.realpath(self.path))
        with _held_guard:
            if key in _held:
                raise self._refuse(f"{Holder.mine().describe()} (this same process)")
            _held.add(key)
        try:
            self._acquire(mode)
        except BaseException:
            with _held_guard:
                _held.discard(key)
            raise
        self._held_key = key
        return self

    def _acquire(self, mode: str) -> None:
        if mode == "file":
            _log_once(self.log, "locks: using lock files (output.lock=file)")
            return self._excl_lock()
        if mode == "auto":
            why = node_local_flock(self.path.parent)
            if why:
                _log_once(self.log, f"locks: {why}: flock there locks only within one node; using lock files")
                return self._excl_lock()
        try:
            fd = _flocked(self.path)
        except BlockingIOError:
            holder = _read(self.path)[0] or Holder()
            raise self._refuse(holder.describe()) from None
        except OSError as e:
            if e.errno not in FLOCK_UNSUPPORTED:
                raise
            _log_once(
                self.log,
                f"locks: flock unsupported on this filesystem ({errno.errorcode.get(e.errno or 0, e.errno)}: "
                f"{e.strerror}); using lock files",
            )
            return self._excl_lock()
        self.fd = fd
        try:
            self._check_previous()
            self.nonce = uuid.uuid4().hex
            self._write_record(Holder.mine(self.nonce))  # publish first,
            _after_publish()
            self._check_lock_file()  # then look at the other mechanism,
            self._check_still_ours()  # then make sure nobody wrote over us meanwhile
        except BaseException as e:
            self._drop_flock()
            if isinstance(e, OSError) and refused_write(e) is not None:
                raise storage_error(self.path, e) from None
            raise

    def _check_previous(self) -> None:
        """flock granted: still refuse a live holder recorded on another node (flock may be
        node-local without saying so)."""
        holder = self._record()
        if holder is None or holder.released or _same_machine(holder):
            return  # flock is exact within one machine
        judged = judge_holder(holder)
        if judged.verdict is Verdict.ALIVE:
            raise self._refuse(f"{holder.describe()} ({judged.why}; flock here seems to lock only within a node)")
        if judged.verdict is Verdict.UNKNOWN:
            # flock was granted: on a filesystem that locks across nodes that is the proof.
            self.log(f"{self.path}: previous holder {holder.describe()} not checked ({judged.why}); flock granted")

    def _check_lock_file(self) -> None:
        """Refuse while a process that chose the lock-file mode holds `<lock>.excl` (or cannot be
        judged): it publishes its lock before it looks at ours, so one of us sees the other."""
        holder, _ = _read(self.path.with_name(self.path.name + ".excl"))
        if holder is None:
            return
        judged = judge_holder(holder)
        if judged.verdict is not Verdict.DEAD:
            raise _refusal(
                self._refuse, holder, judged, self.path.with_name(self.path.name + ".excl"), " (lock-file mode)"
            )

    def _check_still_ours(self) -> None:
        """Refuse when the flock file no longer carries our record: a process on another node was
        granted a node-local flock and wrote over it; it keeps the lock."""
        holder = self._record()
        if holder is None or holder.nonce != self.nonce:
            who = holder.describe() if holder else "an unknown holder"
            raise self._refuse(
                f"{who} (it wrote its record over ours after flock granted the lock to both: flock on "
                f"this filesystem locks only within a node; set output.lock=file)"
            )

    def _record(self) -> Optional[Holder]:
        """The record in the locked file, read through our descriptor: on NFS, closing any other
        descriptor of the file would drop our (POSIX) lock."""
        assert self.fd is not None
        try:
            return Holder.from_record(json.loads(os.pread(self.fd, 1 << 16, 0) or b"{}"))
        except (OSError, ValueError):
            return None

    def _write_record(self, holder: Holder) -> None:
        assert self.fd is not None
        data = json.dumps(holder.record()).encode()
        if _writable(self.fd):
            fd, own = self.fd, False  # NFS: the locked descriptor is writable, and must stay the only one
        else:
            fd, own = os.open(self.path, os.O_WRONLY), True  # flock is per open file: this one is harmless
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
            os.fsync(fd)
        finally:
            if own:
                os.close(fd)

    def _drop_flock(self) -> None:
        """Let go of flock, saying so in the record while it is ours (a process that wrote over it
        holds the lock, its record stays)."""
        if self.fd is None:
            return
        try:
            holder = self._record()
            if self.nonce is not None and holder is not None and holder.nonce == self.nonce:
                self._write_record(replace(Holder.mine(self.nonce), released=True, released_at=time.time()))
        except OSError:
            pass  # the lock is dropped at close anyway; the record is only advice
        os.close(self.fd)
        self.fd = None
        self.nonce = None

    def _excl_lock(self) -> None:
        excl = _ExclFile(self.path.with_name(self.path.name + ".excl"), self._refuse, self.log)
        excl.acquire()  # published first,
        # then a process that took flock on this name (another node whose mount options differ,
        # or output.lock changed meanwhile): do not write beside it while it may run,
        holder, _ = _read(self.path)
        if holder is not None and not holder.released:
            judged = judge_holder(holder)
            if judged.verdict is not Verdict.DEAD:
                excl.release()
                raise _refusal(self._refuse, holder, judged, self.path, " (flock mode)")
        if not excl.holds():  # then make sure we were not taken over meanwhile
            holder, _ = _read(excl.path)
            raise self._refuse(f"{(holder or Holder()).describe()} (it took the lock file over from us)")
        self.excl = excl

    def __exit__(self, *exc: Any) -> None:
        self._drop_flock()
        if self.excl is not None:
            self.excl.release()
            self.excl = None
        if self._held_key is not None:
            with _held_guard:
                _held.discard(self._held_key)
            self._held_key = None


class ShardLock(FileLock):
    """One writer per shard (DIR/shards/NNNNN/lock); the mode comes from DIR/run.yaml's output.lock."""

    def __init__(self, shard_dir: Path, log: Callable[[str], None] = print, mode: Optional[str] = None):
        name = shard_dir.name
        super().__init__(
            shard_dir / "lock",
            lambda who: f"{name}: shard is being written by {who}; wait for it or cancel it",
            log,
            mode,
        )

    def _default_mode(self) -> str:
        return configured_mode(self.path.parent.parent.parent)


class RunLock(FileLock):
    """One merge at a time per run directory (DIR/merge.lock)."""

    def __init__(self, run_dir: Path, log: Callable[[str], None] = print, mode: Optional[str] = None):
        super().__init__(
            run_dir / "merge.lock",
            lambda who: f"{run_dir} is being merged by {who}; wait for it to finish",
            log,
            mode,
        )

    def _default_mode(self) -> str:
        return configured_mode(self.path.parent)
