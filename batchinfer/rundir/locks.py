"""Locks on a run directory: one writer per shard, one merge per run directory.

Two mechanisms, chosen per filesystem (`output.lock`: auto | flock | file):

flock
    Taken through a descriptor open for reading and writing on `<lock>`. The kernel drops it when
    the holder dies, so a dead holder's lock is free. The file also holds the holder's record; a
    record naming a live Slurm job on another node is refused even when flock grants the lock
    (flock that is silently node-local). A clean release writes a "released" record; the file is
    never unlinked (unlinking a flock file races with a process that has it open and locks it).

lock file (`<lock>.excl`)
    For filesystems where flock fails (Lustre `noflock`: ENOSYS; ENOLCK; EOPNOTSUPP) or only locks
    within one node (Lustre `localflock`, NFS `local_lock=flock|all`, `nolock`). Relies on what
    NFSv3+ and Lustre make atomic across nodes: `link` (and `O_EXCL` create) of a name that
    exists fails.

    - The holder record {host, pid, slurm_job, since, nonce} is written to a temporary file,
      fsynced, then linked to `<lock>.excl`: the lock file is never empty. On NFS a retransmitted
      LINK can answer EEXIST although it succeeded; the temporary's link count (2) tells.
    - An existing holder is judged: our own Slurm job id (a requeued task keeps it) is not a
      foreign holder; a Slurm holder by `squeue` (alive states refuse; "Invalid job id" or no
      line = dead); a holder Slurm did not answer for is refused and the lock kept, never
      stolen; a non-Slurm holder on this host by its pid; one on another host cannot be judged
      and is refused. An empty or unreadable lock file is stale only when older than
      LOCK_UNREADABLE_STALE_S by the filesystem's clock (the mtime of a file created now).
    - Taking over a stale lock cannot succeed twice. The stale lock is identified by a key (its
      nonce, or inode and mtime for a record without one). A taker must first create
      `<lock>.excl.takeover-<key>-<g>` by link, which only one process can do; it then re-reads
      `<lock>.excl`, and only if that still carries the key does it `os.replace` its own record
      over it. Every other writer of `<lock>.excl` is excluded at that moment: the stale holder
      is dead, a fresh creator's link fails while the name exists, a release unlinks only its own
      nonce, and any other taker of the same key needs the same marker name. A taker that dies
      holding the marker leaves it to be judged like a lock; once its holder is judged dead the
      next generation `<g+1>` is claimed, again by one process only. After the replace the key is
      gone from `<lock>.excl`, so a late taker's re-read fails and it gives up. Release unlinks
      `<lock>.excl` only while it still carries our nonce.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from batchinfer.errors import RunDirError
from batchinfer.mounts import mount_of, read_mounts
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
_TAKEOVER_GENERATIONS = 32
_logged: set[str] = set()


def own_job() -> Optional[str]:
    """This process's Slurm job id (A_T for an array task; a requeued task keeps it)."""
    job = os.environ.get("SLURM_ARRAY_JOB_ID")
    return f"{job}_{os.environ.get('SLURM_ARRAY_TASK_ID')}" if job else os.environ.get("SLURM_JOB_ID")


def holder_info() -> dict[str, Any]:
    """Who holds a lock: host, pid, Slurm job id."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job": own_job(), "since": time.time()}


def describe_holder(info: dict[str, Any]) -> str:
    """Readable holder of a lock."""
    job = f", Slurm job {info['slurm_job']}" if info.get("slurm_job") else ""
    return f"host {info.get('host')} pid {info.get('pid')}{job}"


def _log_once(log: Callable[[str], None], message: str) -> None:
    """Say a filesystem fact once per process, not at every shard."""
    if message not in _logged:
        _logged.add(message)
        log(message)


def _squeue_state(job: str, timeout: float) -> tuple[str, str]:
    """Judge a Slurm job: ("alive" | "dead" | "unknown", why)."""
    try:
        out = subprocess.run(
            ["squeue", "-h", "-j", str(job), "-o", "%T"], capture_output=True, text=True, timeout=timeout
        )
    except FileNotFoundError:
        return "unknown", "squeue is not installed here"
    except subprocess.TimeoutExpired:
        return "unknown", f"squeue did not answer within {timeout:g} s"
    except OSError as e:
        return "unknown", f"squeue could not run ({e})"
    if "Invalid job id" in out.stderr:
        return "dead", "Slurm no longer knows the job"  # purged after MinJobAge
    if out.returncode != 0:
        return "unknown", f"squeue failed: {(out.stderr.strip() or f'exit {out.returncode}')[:200]}"
    states = out.stdout.split()
    if not states:
        return "dead", "the job is no longer queued"
    alive = [s for s in states if s in SLURM_ALIVE]
    return ("alive", alive[0]) if alive else ("dead", states[0])


def judge_holder(info: dict[str, Any]) -> tuple[str, str]:
    """Whether a lock's recorded holder still runs: ("own" | "alive" | "dead" | "unknown", why)."""
    job = info.get("slurm_job")
    if job and job == own_job():
        return "own", "our own Slurm job (requeued)"
    if job:
        return _squeue_state(str(job), SQUEUE_TIMEOUT_S)
    if info.get("host") == socket.gethostname() and info.get("pid"):
        try:
            os.kill(int(info["pid"]), 0)
        except ProcessLookupError:
            return "dead", "no such process"
        except PermissionError:
            pass  # someone else's live process
        return "alive", "process running"
    return "unknown", "on another host without a Slurm job"


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
    return None


def _read(path: Path) -> tuple[Optional[dict[str, Any]], Optional[os.stat_result]]:
    """A lock file's record (None: empty or unreadable) and its stat (None: absent)."""
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
        info = json.loads(data)
    except ValueError:
        return None, st
    return (info if isinstance(info, dict) else None), st


def _flocked(path: Path) -> int:
    """A descriptor of path holding an exclusive flock (BlockingIOError: held elsewhere).

    Read-only where that works, so a lock held for hours never blocks remounting the filesystem
    read-only; NFS emulates flock with POSIX locks, whose exclusive lock needs a descriptor open
    for writing (EBADF otherwise), so there it is taken again through a writable one."""
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


def _read_holder(path: Path) -> dict[str, Any]:
    """A lock file's holder record, {} when empty or unreadable."""
    return _read(path)[0] or {}


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


class _ExclFile:
    """The lock-file mechanism on one name (see the module docstring)."""

    def __init__(self, path: Path, refuse: Callable[[str], RunDirError], log: Callable[[str], None]):
        self.path = path
        self.refuse = refuse
        self.log = log
        self.nonce = uuid.uuid4().hex
        self.record = dict(holder_info(), nonce=self.nonce)

    def acquire(self) -> None:
        """Take the lock or raise the refusal naming its holder."""
        for _ in range(8):
            if self._create(self.path, self.record):
                self._clean_leftovers()
                return
            info, st = _read(self.path)
            if st is None:
                continue  # released meanwhile
            key = _key(info, st)
            if info is None:
                age = fs_age(self.path, st)
                if age < LOCK_UNREADABLE_STALE_S:
                    raise self.refuse(
                        f"an unknown holder (the lock file {self.path} is empty or unreadable, {age:.0f} s old; "
                        f"it counts as stale after {LOCK_UNREADABLE_STALE_S:g} s)"
                    )
                why = f"an empty or unreadable lock file {age:.0f} s old"
            else:
                why = self._judge_or_refuse(info, self.path)
            self.log(f"{self.path}: taking over the stale lock of {why}")
            if self.takeover(key):
                self._clean_leftovers()
                return
        raise self.refuse(f"others (the lock file {self.path} kept changing; try again)")

    def _judge_or_refuse(self, info: dict[str, Any], path: Path) -> str:
        """Describe a holder that may be replaced, or raise the refusal that keeps it."""
        verdict, why = judge_holder(info)
        who = describe_holder(info)
        if verdict == "alive":
            raise self.refuse(who)
        if verdict == "unknown" and info.get("slurm_job"):
            raise self.refuse(
                f"{who}; Slurm did not answer ({why}), so the lock is kept, never stolen: try again later"
            )
        if verdict == "unknown":
            raise self.refuse(
                f"{who} ({why}: it cannot be checked from here); if that process is gone, remove {path} by hand"
            )
        return f"{who} ({why})"

    def takeover(self, key: str) -> bool:
        """Replace the stale lock identified by key with ours; False when it changed meanwhile."""
        for g in range(1, _TAKEOVER_GENERATIONS + 1):
            marker = self.path.with_name(f"{self.path.name}.takeover-{key}-{g}")
            if self._create(marker, self.record):
                break
            info, st = _read(marker)
            if st is None:
                return False  # its taker finished and removed it: re-read the lock
            if info is None:
                if fs_age(marker, st) < LOCK_UNREADABLE_STALE_S:
                    raise self.refuse(f"another process taking the stale lock over ({marker})")
            elif info.get("nonce") != self.nonce:
                self._judge_or_refuse(info, marker)  # a live taker keeps it; a dead one: next generation
        else:
            raise self.refuse(f"others (too many takeovers of {self.path} died half way; remove it by hand)")
        try:
            _after_claim()
            info, st = _read(self.path)
            if st is None or _key(info, st) != key:
                return False  # released or taken over by someone else: start again
            tmp = self._write_temp(self.record)
            os.replace(tmp, self.path)
            fsync_dir(self.path.parent)
            return True
        finally:
            marker.unlink(missing_ok=True)

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
        info, _ = _read(self.path)
        if info is not None and info.get("nonce") == self.nonce:
            self.path.unlink(missing_ok=True)


def _key(info: Optional[dict[str, Any]], st: os.stat_result) -> str:
    """What identifies one holder's lock file: its nonce, else the file itself."""
    nonce = info.get("nonce") if info else None
    return str(nonce) if nonce else f"i{st.st_ino}.{st.st_mtime_ns}"


def _after_claim() -> None:
    """Between claiming a takeover and re-reading the lock (tests interleave a second taker here)."""


def _configured_mode(run_dir: Path) -> str:
    """output.lock from DIR/run.yaml (auto when absent: older run directories)."""
    import yaml

    try:
        run = yaml.safe_load((run_dir / "run.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return "auto"
    return str(((run.get("config") or {}).get("output") or {}).get("lock") or "auto")


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
        self.excl: Optional[_ExclFile] = None

    def _refuse(self, holder: str) -> RunDirError:
        return RunDirError(self.busy(holder))

    def _default_mode(self) -> str:
        return "auto"

    def __enter__(self) -> FileLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        mode = self.mode or self._default_mode()
        if mode not in LOCK_MODES:
            raise RunDirError(f"output.lock={mode!r} is not one of: {', '.join(LOCK_MODES)}")
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
            raise self._refuse(describe_holder(_read_holder(self.path))) from None
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
            self._check_record()
            self._write_record(dict(holder_info(), nonce=uuid.uuid4().hex))
        except BaseException as e:
            os.close(fd)
            self.fd = None
            if isinstance(e, OSError) and refused_write(e) is not None:
                raise storage_error(self.path, e) from None
            raise
        return self

    def _check_record(self) -> None:
        """flock granted: still refuse a live holder on another node (flock may be node-local),
        or a live holder of the lock file (a process that chose the lock-file mode)."""
        excl = _read_holder(self.path.with_name(self.path.name + ".excl"))
        if excl and judge_holder(excl)[0] == "alive":
            raise self._refuse(f"{describe_holder(excl)} (lock-file mode)")
        info = self._own_record()
        if not info or info.get("released") or info.get("host") == socket.gethostname():
            return  # flock is exact within one node
        job = info.get("slurm_job")
        if not job or job == own_job():
            return
        verdict, why = _squeue_state(str(job), SQUEUE_TIMEOUT_S)
        if verdict == "alive":
            raise self._refuse(f"{describe_holder(info)} (Slurm: {why}; flock here seems to lock only within a node)")
        if verdict == "unknown":
            self.log(f"{self.path}: previous holder {describe_holder(info)} not checked ({why}); flock granted")

    def _own_record(self) -> dict[str, Any]:
        """The record in the locked file, read through our descriptor: on NFS, closing any other
        descriptor of the file would drop our (POSIX) lock."""
        assert self.fd is not None
        try:
            info = json.loads(os.pread(self.fd, 1 << 16, 0) or b"{}")
        except (OSError, ValueError):
            return {}
        return info if isinstance(info, dict) else {}

    def _write_record(self, record: dict[str, Any]) -> None:
        assert self.fd is not None
        data = json.dumps(record).encode()
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

    def _excl_lock(self) -> FileLock:
        excl = _ExclFile(self.path.with_name(self.path.name + ".excl"), self._refuse, self.log)
        excl.acquire()
        # A process that took flock on this name (another node whose mount options differ, or
        # output.lock changed meanwhile) and still runs: do not write beside it.
        info = _read_holder(self.path)
        if info and not info.get("released") and judge_holder(info)[0] == "alive":
            excl.release()
            raise self._refuse(f"{describe_holder(info)} (flock mode)")
        self.excl = excl
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.fd is not None:
            try:
                self._write_record(dict(holder_info(), released=True, released_at=time.time()))
            except OSError:
                pass  # the lock is dropped at close anyway; the record is only advice
            os.close(self.fd)
            self.fd = None
        if self.excl is not None:
            self.excl.release()
            self.excl = None


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
        return _configured_mode(self.path.parent.parent.parent)


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
        return _configured_mode(self.path.parent)
