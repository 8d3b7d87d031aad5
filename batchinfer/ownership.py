"""One owner for every folder: the one place where a command creates a folder it owns, recognises
it later, adopts a half-made one whose maker is dead, publishes a finished one by renaming it into
an absent name, and removes only what it made (issue 40). Nothing else removes or renames a run's
folders (tests/contract/test_ownership_rule.py).

On disk, a folder batchinfer made holds, beside what its command puts there:
- `.batchinfer-owner.json` (MARK): who made it and whether it is finished,
  {"command": "prepare", "state": "making" | "done", "token": "<hex>", "made": <epoch s>,
   "maker": {host, pid, pid_start, boot_id, pid_ns, slurm_job, ...}} (the lock's holder record);
- `.batchinfer-owner.lock` (LOCK; `LOCK.excl` in lock-file mode): the folder's lock, the shard
  locks' own mechanism (locks/: flock where it locks across nodes, else a lock file published by
  link and taken over only from a provably dead holder), so it holds on NFS and Lustre.

API (every refusal is a FolderRefused, exit 2, one line naming the folder and its holder):
- `recognise(path, legacy=None) -> Found`: what path is, with its mark and a judgement of its
  maker (alive: same machine by pid and start time, else by Slurm, as a lock's holder). Kind:
  ABSENT; EMPTY (nothing but our own names); MAKING (mark "making", maker alive or not judgeable);
  HALF_MADE (mark "making", maker provably dead); DONE; FOREIGN (not empty, no mark);
  NOT_A_FOLDER (a file, or a symlink: never followed). `legacy(path)` may name what an unmarked
  folder of an older batchinfer is (Kind.DONE or Kind.HALF_MADE); None: it is FOREIGN.
- `claim(path, command, *, mode="auto", legacy=None, label="") -> ContextManager[Claim]`: make
  path (parents too) or take it, holding its lock for the whole `with` body. EMPTY is marked
  "making" (Claim.fresh); HALF_MADE is adopted (Claim.adopted; `Claim.clear()` removes the dead
  maker's contents); DONE is handed over as it is (Claim.existing: never removed, never marked).
  FOREIGN, NOT_A_FOLDER, MAKING and a held lock are refused. A clean exit marks a fresh or
  adopted folder "done"; when the body raises, what this claim made is removed (only while the
  mark carries its token; the folder itself only when this claim created it). A claim of a folder
  this process already claims is the inner one (Claim.inner: neither fresh, adopted nor existing;
  it fills the folder, and the outer claim alone marks or removes it): a redo claims its pass
  folder, writes its selection, then prepares the run directory in it.
- `hold(path, command, *, mode="auto") -> ContextManager[FileLock]`: a folder's lock alone, for a
  command that changes an existing folder of its own (a redo: check, select, claim the pass). A
  process takes one folder's lock once: never `claim` a folder inside a `hold` of that folder.
- `stage(parent, tag, command) -> ContextManager[Claim]`: a fresh folder `.tmp-<tag>-<random>` in
  parent, marked "making", removed at exit unless published (its random name is its lock).
- `publish(staged, dest) -> bool`: mark the staged folder "done", rename it to dest. False when
  dest is there and not empty (another process published meanwhile, or not ours: recognise it);
  rename replaces only an absent name or an empty folder, never follows a symlink.
- `sweep(parent, tag)`: remove staged folders of that tag whose maker is provably dead.
- `refusal(found, label) -> FolderRefused`: the one-line refusal of what recognise found;
  `read_mark(folder) -> Mark | None`: the mark alone (`Mark.describe()` names the maker)."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Optional, TypedDict

from batchinfer.durable import fsync_dir, read_json, write_json
from batchinfer.errors import FolderRefused
from batchinfer.locks.holder import Holder, HolderRecord, Verdict
from batchinfer.locks.judge import judge_holder
from batchinfer.locks.lock import FileLock
from batchinfer.logs import log
from batchinfer.security import remove_path

MARK = ".batchinfer-owner.json"
LOCK = ".batchinfer-owner.lock"
_OURS = ".batchinfer-owner"  # in every name of the mark, the lock and their temporaries
_PROBES = ("lock.clock-", ".flock-probe-")  # the lock's filesystem probes, there for an instant


class State(Enum):
    """Whether the folder's maker finished it."""

    MAKING = "making"
    DONE = "done"


class Kind(Enum):
    """What a folder is to a command that wants it."""

    ABSENT = "absent"
    EMPTY = "empty"
    MAKING = "making"
    HALF_MADE = "half-made"
    DONE = "done"
    FOREIGN = "foreign"
    NOT_A_FOLDER = "not a folder"


class MarkRecord(TypedDict):
    """MARK's JSON, as Mark.record writes it."""

    command: str
    state: str  # a State's value
    token: str
    made: float
    maker: HolderRecord


@dataclass(frozen=True)
class Mark:
    """The record in MARK: which command made the folder, which process, and whether it finished."""

    command: str
    state: State
    token: str
    made: float
    maker: Holder

    def record(self) -> MarkRecord:
        """MARK's JSON."""
        return {
            "command": self.command,
            "state": self.state.value,
            "token": self.token,
            "made": self.made,
            "maker": self.maker.record(),
        }

    def describe(self) -> str:
        """`batchinfer prepare (host h pid 1, since 04:50:01)`, for refusals."""
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.made))
        return f"batchinfer {self.command} ({self.maker.describe()}, since {since})"


def read_mark(folder: Path) -> Optional[Mark]:
    """The folder's mark; None when it has none (or a name of ours holding no mark)."""
    try:
        rec = read_json(folder / MARK)
        maker = Holder.from_record(rec["maker"])
        mark = Mark(str(rec["command"]), State(rec["state"]), str(rec["token"]), float(rec["made"]), maker or Holder())
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return mark if maker is not None else None


def _write_mark(folder: Path, mark: Mark) -> None:
    write_json(folder / MARK, mark.record(), redact=False)  # its `token` is our claim's, no secret


@dataclass(frozen=True)
class Found:
    """What recognise saw at path: its kind, its mark, and why (the maker's judgement, the names)."""

    path: Path
    kind: Kind
    mark: Optional[Mark] = None
    why: str = ""


def _others(folder: Path) -> list[str]:
    """The folder's names that are not ours (the mark, the lock, their temporaries, lock probes)."""
    return sorted(n for n in os.listdir(folder) if _OURS not in n and not n.startswith(_PROBES))


def recognise(path: Path, legacy: Optional[Callable[[Path], Optional[Kind]]] = None) -> Found:
    """What path is to a command that wants it (see the module docstring)."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return Found(path, Kind.ABSENT)
    if not stat.S_ISDIR(st.st_mode):
        return Found(path, Kind.NOT_A_FOLDER, why="a symlink" if stat.S_ISLNK(st.st_mode) else "a file")
    mark = read_mark(path)
    if mark is not None:
        if mark.state is State.DONE:
            return Found(path, Kind.DONE, mark)
        judged = judge_holder(mark.maker)
        return Found(path, Kind.HALF_MADE if judged.verdict is Verdict.DEAD else Kind.MAKING, mark, judged.why)
    names = _others(path)
    if not names:
        return Found(path, Kind.EMPTY)
    kind = legacy(path) if legacy else None
    if kind in (Kind.DONE, Kind.HALF_MADE):
        return Found(path, kind, why="made by an older batchinfer")
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    return Found(path, Kind.FOREIGN, why=shown)


def refusal(found: Found, label: str = "") -> FolderRefused:
    """The one-line refusal of a folder a command may not take."""
    where = f"{label} {found.path}" if label else str(found.path)
    if found.kind is Kind.NOT_A_FOLDER:
        return FolderRefused(f"{where} is {found.why}, not a folder; choose another")
    if found.kind is Kind.MAKING and found.mark is not None:
        return FolderRefused(
            f"{where} is being made by {found.mark.describe()}: {found.why}; wait for it or choose another folder"
        )
    if found.kind is Kind.FOREIGN:
        return FolderRefused(
            f"{where} is not empty and batchinfer did not make it (it holds {found.why}); batchinfer never "
            f"writes into or clears a folder it did not make: choose a new or empty folder"
        )
    return FolderRefused(f"{where} is {found.kind.value}; choose another folder")


@dataclass
class Claim:
    """A folder a command holds: what it was when claimed, and our mark's token (None: an existing
    finished folder, handed over as it is)."""

    path: Path
    command: str
    found: Found
    token: Optional[str]
    made_dir: bool  # this claim created the folder itself
    inner: bool = False  # inside a claim of the same folder in this process: the outer one decides

    @property
    def fresh(self) -> bool:
        """An empty or new folder, marked by this claim."""
        return not self.inner and self.token is not None and self.found.kind in (Kind.EMPTY, Kind.ABSENT)

    @property
    def adopted(self) -> bool:
        """A half-made folder whose maker is dead, now ours."""
        return not self.inner and self.token is not None and self.found.kind is Kind.HALF_MADE

    @property
    def existing(self) -> bool:
        """A finished folder, handed over as it is."""
        return not self.inner and self.token is None

    def ours(self) -> bool:
        """Whether the folder's mark still carries our token."""
        mark = read_mark(self.path)
        return self.token is not None and mark is not None and mark.token == self.token

    def clear(self) -> None:
        """Remove every entry but our own names (an adopted folder: the dead maker's contents)."""
        if not self.ours():
            raise FolderRefused(f"{self.path}: its mark is no longer this command's; nothing removed")
        for name in _others(self.path):
            remove_path(self.path / name)  # a symlink is unlinked, never followed

    def done(self) -> None:
        """Mark the folder finished."""
        mark = read_mark(self.path)
        if mark is not None and self.ours():
            _write_mark(self.path, replace(mark, state=State.DONE))

    def remove(self) -> bool:
        """Remove what this claim made (contents and mark) while the mark is ours; whether it did."""
        if not self.ours():
            return False
        self.clear()
        (self.path / MARK).unlink(missing_ok=True)
        return True


_active: dict[str, Claim] = {}  # this process's claims by real path (a claim inside one is the inner)


def _folder_lock(path: Path, command: str, mode: str, label: str) -> FileLock:
    where = f"{label} {path}" if label else str(path)

    def busy(who: str) -> str:
        mark = read_mark(path)
        doing = f" (batchinfer {mark.command})" if mark and mark.state is State.MAKING else ""
        return f"{where} is in use by {who}{doing}; wait for it to finish or choose another folder"

    return FileLock(path / LOCK, busy, mode=mode, log=log.warning, error=FolderRefused)


def _make_dir(path: Path, label: str) -> bool:
    """Create path (parents too); whether this call created path itself."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir()
        return True
    except FileExistsError:
        return False
    except OSError as e:
        where = f"{label} {path}" if label else str(path)
        raise FolderRefused(f"{where}: cannot create it ({e.strerror}); choose a writable folder") from None


def _take(
    path: Path, command: str, legacy: Optional[Callable[[Path], Optional[Kind]]], label: str, made: bool
) -> Claim:
    """Under the folder's lock: mark an empty or half-made folder ours, hand over a finished one."""
    found = recognise(path, legacy)
    if found.kind is Kind.DONE:
        return Claim(path, command, found, None, made)
    if found.kind not in (Kind.EMPTY, Kind.HALF_MADE):
        raise refusal(found, label)
    token = uuid.uuid4().hex
    _write_mark(path, Mark(command, State.MAKING, token, time.time(), Holder.mine()))
    return Claim(path, command, found, token, made)


@contextlib.contextmanager
def claim(
    path: Path,
    command: str,
    *,
    mode: str = "auto",
    legacy: Optional[Callable[[Path], Optional[Kind]]] = None,
    label: str = "",
) -> Iterator[Claim]:
    """Hold path as this command's (see the module docstring)."""
    path = Path(path)
    outer = _active.get(os.path.realpath(path))
    if outer is not None:  # this process holds it already: the caller fills it, the outer claim decides
        yield Claim(path, command, Found(path, Kind.MAKING, read_mark(path)), outer.token, False, inner=True)
        return
    found = recognise(path, legacy)
    if found.kind in (Kind.NOT_A_FOLDER, Kind.FOREIGN, Kind.MAKING):
        raise refusal(found, label)  # before the lock: nothing is written into another's folder
    made = _make_dir(path, label)
    removed = False
    try:
        with _folder_lock(path, command, mode, label) as lock:
            try:
                owned = _take(path, command, legacy, label, made)
            except FolderRefused:
                lock.unlink_held()  # it became another's since the look above: leave nothing of ours
                raise
            key = os.path.realpath(path)
            _active[key] = owned
            try:
                yield owned
            except BaseException:
                if owned.remove():
                    lock.unlink_held()  # ours too; a contender re-opens it (locks/filesystems.flocked)
                    removed = made
                raise
            finally:
                _active.pop(key, None)
            owned.done()
    finally:
        if removed:
            _rmdir(path)


def _rmdir(path: Path) -> None:
    """Remove a folder this command created, if nothing is left in it (a contender's lock keeps it)."""
    with contextlib.suppress(OSError):
        os.rmdir(path)


@contextlib.contextmanager
def hold(path: Path, command: str, *, mode: str = "auto") -> Iterator[FileLock]:
    """A folder's lock alone, for the `with` body."""
    with _folder_lock(Path(path), command, mode, "") as lock:
        yield lock


@contextlib.contextmanager
def stage(parent: Path, tag: str, command: str) -> Iterator[Claim]:
    """A fresh folder `.tmp-<tag>-<random>` in parent, ours, removed at exit unless published."""
    parent.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(dir=parent, prefix=f".tmp-{tag}-"))
    token = uuid.uuid4().hex
    _write_mark(path, Mark(command, State.MAKING, token, time.time(), Holder.mine()))
    owned = Claim(path, command, Found(path, Kind.ABSENT), token, True)
    try:
        yield owned
    finally:
        if os.path.lexists(path) and owned.remove():
            _rmdir(path)


def publish(staged: Claim, dest: Path) -> bool:
    """Mark staged "done" and rename it to dest; False when dest is there and not empty."""
    mark = read_mark(staged.path)
    if mark is None or mark.token != staged.token:
        raise FolderRefused(f"{staged.path}: not a folder this command staged; not published")
    _write_mark(staged.path, replace(mark, state=State.DONE))
    try:
        os.rename(staged.path, dest)  # never replaces a non-empty folder, never follows a symlink
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
            _write_mark(staged.path, mark)
            return False
        raise
    fsync_dir(Path(dest).parent)
    return True


def sweep(parent: Path, tag: str) -> None:
    """Remove the staged folders of that tag whose maker is provably dead (killed half way)."""
    if not parent.is_dir():
        return
    for p in parent.glob(f".tmp-{tag}-*"):
        mark = read_mark(p) if p.is_dir() and not p.is_symlink() else None
        if mark is not None and judge_holder(mark.maker).verdict is Verdict.DEAD:
            remove_path(p, ignore_errors=True)
