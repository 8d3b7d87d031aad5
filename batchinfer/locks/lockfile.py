"""The lock-file mechanism (`<lock>.excl`), for filesystems where flock fails (Lustre `noflock`:
ENOSYS; ENOLCK; EOPNOTSUPP) or only locks within one node (Lustre `localflock`, NFS
`local_lock=flock|all`, `nolock`, BeeGFS without `tuneUseGlobalFileLocks`). Relies on what NFSv3+
and Lustre make atomic across nodes: `link` (and `O_EXCL` create) of a name that exists fails.

- The holder record (`Holder`) is written to a temporary file, fsynced, then linked to
  `<lock>.excl`: the lock file is never empty. On NFS a retransmitted LINK can answer EEXIST
  although it succeeded; the temporary's link count (2) tells. Once linked, the flock record of
  the other mechanism is checked (lock.py), then our lock file re-read.
- An existing holder is judged (judge.py) and its lock is free only when it is provably dead. An
  empty or unreadable lock file is stale only when older than LOCK_UNREADABLE_STALE_S by the
  filesystem's clock (the mtime of a file created now).
- Taking over a stale lock cannot succeed twice. The stale lock is identified by a key (its
  nonce, or inode and mtime for a record without one). A taker must first create
  `<lock>.excl.takeover-<key>-<g>` by link, which only one process can do; it then re-reads
  `<lock>.excl`, and only if that still carries the key does it `os.replace` its own record over
  it. Every other writer of `<lock>.excl` is excluded at that moment: the stale holder is dead, a
  fresh creator's link fails while the name exists, a release unlinks only its own nonce, and
  any other taker of the same key needs the same marker name. A taker that dies holding the
  marker leaves it to be judged like a lock (a live taker of our own job included); once its
  holder is judged dead the next generation `<g+1>` is claimed, again by one process only. After
  the replace the key is gone from `<lock>.excl`, so a late taker's re-read fails and it gives
  up. Release unlinks `<lock>.excl` only while it still carries our nonce; since only a provably
  dead holder's lock is ever replaced, nobody replaces a live holder's lock between its
  release's read and its unlink."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from batchinfer.durable import fsync_dir
from batchinfer.errors import RunDirError
from batchinfer.locks.filesystems import fs_age, fs_now
from batchinfer.locks.holder import Holder, HolderRecord, Verdict, read_holder
from batchinfer.locks.judge import judge_holder, refusal

# An empty or unreadable lock file older than this (filesystem clock) is stale: its writer was
# killed between create and write (an older batchinfer) or the file was damaged.
LOCK_UNREADABLE_STALE_S = 300.0
_TAKEOVER_GENERATIONS = 32


class ExclFile:
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
            holder, st = read_holder(self.path)
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
            raise refusal(self.refuse, holder, judged, path)
        return f"{holder.describe()} ({judged.why})"

    def takeover(self, key: str) -> bool:
        """Replace the stale lock identified by key with ours; False when it changed meanwhile."""
        for g in range(1, _TAKEOVER_GENERATIONS + 1):
            marker = self.path.with_name(f"{self.path.name}.takeover-{key}-{g}")
            if self._create(marker, self.record):
                break
            holder, st = read_holder(marker)
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
            holder, st = read_holder(self.path)
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
        holder, _ = read_holder(self.path)
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

    def _write_temp(self, record: HolderRecord) -> Path:
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

    def _create(self, name: Path, record: HolderRecord) -> bool:
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
