"""The shard and merge locks: one holder of a named lock in a run directory, by flock where it
works, else by a lock file (lockfile.py), in the mode its caller passes (mode.py).

flock is taken through a descriptor of `<lock>`. The kernel (or the filesystem's lock manager)
drops it when the holder dies, so a dead holder's lock is free. On NFS, flock is emulated with
POSIX record locks: per process (a second descriptor in the same process is granted it too),
dropped when the process closes ANY descriptor of the file, not inherited by children, and an
exclusive one needs a descriptor open for writing (EBADF otherwise). So a process never opens a
lock file it may hold a second time (`_held` refuses a second lock of one name in one process
before any open), and reads and writes its record through the locked descriptor.

The file also holds the holder's record. Once flock is granted: a record naming a live holder on
another node is refused (flock that is silently node-local); then our own record is published,
then the lock file of the other mechanism is checked, then the record is re-read: another node
that wrote its record over ours after we checked holds a node-local flock too, and we give way.
A clean release writes a "released" record; the file is never unlinked (unlinking a flock file
races with a process that has it open and locks it). The lock-file mechanism checks the flock
record in turn once its own lock file is published, so of two processes in different modes one
sees the other."""

from __future__ import annotations

import errno
import json
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from batchinfer.durable import refused_write, storage_error
from batchinfer.errors import RunDirError
from batchinfer.locks.filesystems import FLOCK_UNSUPPORTED, flocked, node_local_flock, writable
from batchinfer.locks.holder import Holder, Verdict, read_holder
from batchinfer.locks.judge import judge_holder, refusal, same_machine
from batchinfer.locks.lockfile import ExclFile
from batchinfer.locks.mode import LOCK_MODES

_logged: set[str] = set()
# The locks this process holds, by (pid, path): a second lock of one name in one process is
# refused before the file is opened (POSIX locks are per process, and closing a second
# descriptor would drop the first one's lock).
_held: set[tuple[int, str]] = set()
_held_guard = threading.Lock()
# The flock holder's record is written just after flock is granted: a refused taker re-reads an
# empty one after these pauses (seconds, 0.75 in all) before it names no holder.
RECORD_PAUSES: tuple[float, ...] = (0.05, 0.1, 0.2, 0.4)
STARTING = "another batchinfer starting now (its holder record is not written yet)"


def _log_once(log: Callable[[str], None], message: str) -> None:
    """Say a filesystem fact once per process, not at every shard."""
    if message not in _logged:
        _logged.add(message)
        log(message)


def _after_publish() -> None:
    """Between publishing our record and checking the other mechanism (tests interleave here)."""


class FileLock:
    """One holder of a named lock in a run directory: flock where it works, else a lock file."""

    def __init__(
        self,
        path: Path,
        busy: Callable[[str], str],
        *,
        mode: str,
        log: Callable[[str], None] = print,
        error: type[RunDirError] = RunDirError,
    ):
        self.path = path
        self.busy = busy  # holder description -> refusal message
        self.error = error  # the refusal's class
        self.log = log
        self.mode = mode  # the caller's choice (mode.py): the lock never reads run.yaml
        self.fd: Optional[int] = None
        self.nonce: Optional[str] = None  # of our record in the flock file
        self.excl: Optional[ExclFile] = None
        self._held_key: Optional[tuple[int, str]] = None

    def _refuse(self, holder: str) -> RunDirError:
        return self.error(self.busy(holder))

    def __enter__(self) -> FileLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        mode = self.mode
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
            fd = flocked(self.path)
        except BlockingIOError:
            raise self._refuse(self._flock_holder()) from None
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

    def _flock_holder(self) -> str:
        """Who holds the flock we were refused, from its record: a holder publishes its record just
        after flock grants it, so an empty (or the previous holder's released) record is re-read a
        few times before the holder is called one starting now."""
        holder = read_holder(self.path)[0]
        for pause in RECORD_PAUSES:
            if holder is not None and not holder.released:
                break
            time.sleep(pause)
            holder = read_holder(self.path)[0]
        if holder is None:
            return STARTING
        if holder.released:
            return f"another batchinfer taking it or letting it go now (the record names {holder.describe()}, released)"
        return holder.describe()

    def _check_previous(self) -> None:
        """flock granted: still refuse a live holder recorded on another node (flock may be
        node-local without saying so)."""
        holder = self._record()
        if holder is None or holder.released or same_machine(holder):
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
        holder, _ = read_holder(self.path.with_name(self.path.name + ".excl"))
        if holder is None:
            return
        judged = judge_holder(holder)
        if judged.verdict is not Verdict.DEAD:
            raise refusal(
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
        if writable(self.fd):
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
        excl = ExclFile(self.path.with_name(self.path.name + ".excl"), self._refuse, self.log)
        excl.acquire()  # published first,
        # then a process that took flock on this name (another node whose mount options differ,
        # or output.lock changed meanwhile): do not write beside it while it may run,
        holder, _ = read_holder(self.path)
        if holder is not None and not holder.released:
            judged = judge_holder(holder)
            if judged.verdict is not Verdict.DEAD:
                excl.release()
                raise refusal(self._refuse, holder, judged, self.path, " (flock mode)")
        if not excl.holds():  # then make sure we were not taken over meanwhile
            holder, _ = read_holder(excl.path)
            who = holder.describe() if holder else "an unknown holder"
            raise self._refuse(f"{who} (it took the lock file over from us)")
        self.excl = excl

    def unlink_held(self) -> None:
        """Remove the flock file while we hold it (its folder is about to go): a process that opened
        it meanwhile finds, once granted, that its descriptor no longer names the file (flocked)."""
        if self.fd is not None:
            self.path.unlink(missing_ok=True)

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
    """One writer per shard (DIR/shards/NNNNN/lock), in the mode the run configures (output.lock)."""

    def __init__(self, shard_dir: Path, *, mode: str, log: Callable[[str], None] = print):
        name = shard_dir.name
        super().__init__(
            shard_dir / "lock",
            lambda who: f"{name}: shard is being written by {who}; wait for it or cancel it",
            mode=mode,
            log=log,
        )


class RunLock(FileLock):
    """One merge at a time per run directory (DIR/merge.lock), in the mode the run configures."""

    def __init__(self, run_dir: Path, *, mode: str, log: Callable[[str], None] = print):
        super().__init__(
            run_dir / "merge.lock",
            lambda who: f"{run_dir} is being merged by {who}; wait for it to finish",
            mode=mode,
            log=log,
        )
