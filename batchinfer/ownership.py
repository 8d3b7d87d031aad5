"""One owner for every folder: the one place where a command creates a folder it owns, recognises
it later, adopts a half-made one whose maker is dead, publishes a finished one by renaming it into
an absent name, and removes only what it made (issue 40). Nothing else removes or renames a run's
folders (tests/contract/test_ownership_rule.py). Its reading side (the mark, Layout, recognise,
refusal) is folder_kinds.py, re-exported here: callers use ownership.

On disk, a folder batchinfer made holds, beside what its command puts there:
- `.batchinfer-owner.json` (MARK): who made it and whether it is finished,
  {"command": "prepare", "state": "making" | "done", "token": "<hex>", "made": <epoch s>,
   "maker": {host, pid, pid_start, boot_id, pid_ns, slurm_job, ...}} (the lock's holder record);
- `.batchinfer-owner.lock` (LOCK; `LOCK.excl` in lock-file mode): the folder's lock, the shard
  locks' own mechanism (locks/: flock where it locks across nodes, else a lock file published by
  link and taken over only from a provably dead holder), so it holds on NFS and Lustre.

A Layout names what a command makes at the top of its folder (`run.yaml`, `input`, `.tmp-*`, ...):
only those names are ever removed from it, and a half-made folder holding any other name (a file
the user put there after the crash) is refused, naming it, never cleared.

API (every refusal is a FolderRefused, exit 2, one line naming the folder and its holder):
- `recognise(path, legacy=None, layout=None) -> Found`: what path is, with its mark and a
  judgement of its maker (alive: same machine by pid and start time, else by Slurm, as a lock's
  holder). Kind: ABSENT; EMPTY (nothing but our own names); MAKING (mark "making", maker alive or
  not judgeable: Found.judged says which); HALF_MADE (mark "making", maker provably dead;
  Found.strays: its names the layout does not make); DONE; FOREIGN (not empty, no mark);
  NOT_A_FOLDER (a file, or a symlink: never followed). `legacy(path)` may name what an unmarked
  folder of an older batchinfer is (Kind.DONE or Kind.HALF_MADE; an unmarked HALF_MADE holding a
  name the layout does not make is FOREIGN); None: it is FOREIGN.
- `claim(path, command, *, layout, mode="auto", legacy=None, label="", within=None)
  -> ContextManager[Claim]`: make path (parents too) or take it, holding its lock for the whole
  `with` body. EMPTY is marked "making" (Claim.fresh); HALF_MADE is adopted (Claim.adopted;
  `Claim.clear()` removes the dead maker's names of the layout, and logs them); DONE is handed
  over as it is (Claim.existing: never removed, never marked). FOREIGN, NOT_A_FOLDER, MAKING, a
  HALF_MADE holding strays and a held lock are refused. A clean exit marks a fresh or adopted
  folder "done"; when the body raises, what this claim made (the layout's names) is removed (only
  while the mark carries its token; the folder itself only when this claim created it and nothing
  else is left in it). `within`: the folder path is made in (a run directory, for its passes):
  no folder between it and path may be a symlink, none is made through one. A claim of a folder
  this process already claims is the inner one (Claim.inner: neither fresh, adopted nor existing;
  it fills the folder, and the outer claim alone marks or removes it): a redo claims its pass
  folder, writes its selection, then prepares the run directory in it.
- `make_dirs(path, within, label="")`: path and its parents below within, through no symlink.
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
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from batchinfer.durable import fsync_dir, write_json
from batchinfer.errors import FolderRefused
from batchinfer.folder_kinds import (
    LOCK,
    MARK,
    Found,
    Kind,
    Layout,
    Mark,
    State,
    others,
    read_mark,
    recognise,
    refusal,
    refused,
    shown,
)
from batchinfer.locks.holder import Holder, Verdict
from batchinfer.locks.judge import judge_holder
from batchinfer.locks.lock import FileLock
from batchinfer.logs import log
from batchinfer.security import remove_path

__all__ = [
    "LOCK",
    "MARK",
    "Claim",
    "Found",
    "Kind",
    "Layout",
    "Mark",
    "State",
    "claim",
    "hold",
    "make_dirs",
    "publish",
    "read_mark",
    "recognise",
    "refusal",
    "stage",
    "sweep",
]


def _write_mark(folder: Path, mark: Mark) -> None:
    write_json(folder / MARK, mark.record(), redact=False)  # its `token` is our claim's, no secret


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
    layout: Optional[Layout] = None  # what the command makes there (None: a staged folder, all ours)

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
        """Remove what the command makes there (an adopted folder: what its dead maker left), never
        another name; say what was removed."""
        if not self.ours():
            raise FolderRefused(f"{self.path}: its mark is no longer this command's; nothing removed")
        names = [n for n in others(self.path) if self.layout is None or self.layout.makes(n)]
        for name in names:
            remove_path(self.path / name)  # a symlink is unlinked, never followed
        if names and self.layout is not None:
            maker = f"this batchinfer {self.command}"
            if self.adopted:
                maker = self.found.mark.describe() if self.found.mark else "an older batchinfer"
            log.info("removed from %s what %s made there: %s", self.path, maker, shown(names))

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


def _no_links(path: Path, within: Path, label: str) -> None:
    """FolderRefused naming the first symlink among the folders from within (excluded) to path."""
    try:
        rel = Path(path).relative_to(within)
    except ValueError:
        raise FolderRefused(f"{path} is not inside {within}; nothing made") from None
    at = Path(within)
    for part in rel.parts:
        at = at / part
        if at.is_symlink():
            where = f"{label} {path}" if label else str(path)
            raise FolderRefused(
                f"{where}: {at} is a symlink (to {os.readlink(at)}); batchinfer makes nothing through a symlink "
                f"inside {within}: remove the link (its target is left alone) and run the same command again"
            )


def make_dirs(path: Path, within: Path, label: str = "") -> None:
    """Create path and its parents below within, one at a time, refusing a symlink among them (one
    planted in a run directory would carry what is made there out of it)."""
    _no_links(path, within, label)
    at = Path(within)
    for part in Path(path).relative_to(within).parts:
        at = at / part
        with contextlib.suppress(FileExistsError):
            os.mkdir(at)
        _no_links(at, within, label)  # a link made meanwhile: mkdir made nothing through it


def _make_dir(path: Path, label: str, within: Optional[Path]) -> bool:
    """Create path (parents too); whether this call created path itself."""
    try:
        if within is not None:
            make_dirs(path.parent, within, label)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir()
        return True
    except FileExistsError:
        return False
    except OSError as e:
        where = f"{label} {path}" if label else str(path)
        raise FolderRefused(f"{where}: cannot create it ({e.strerror}); choose a writable folder") from None


def _take(
    path: Path,
    command: str,
    legacy: Optional[Callable[[Path], Optional[Kind]]],
    layout: Layout,
    label: str,
    made: bool,
) -> Claim:
    """Under the folder's lock: mark an empty or half-made folder ours, hand over a finished one."""
    found = recognise(path, legacy, layout)
    if found.kind is Kind.DONE:
        return Claim(path, command, found, None, made, layout=layout)
    if found.kind not in (Kind.EMPTY, Kind.HALF_MADE) or refused(found):
        raise refusal(found, label)
    token = uuid.uuid4().hex
    _write_mark(path, Mark(command, State.MAKING, token, time.time(), Holder.mine()))
    return Claim(path, command, found, token, made, layout=layout)


@contextlib.contextmanager
def claim(
    path: Path,
    command: str,
    *,
    layout: Layout,
    mode: str = "auto",
    legacy: Optional[Callable[[Path], Optional[Kind]]] = None,
    label: str = "",
    within: Optional[Path] = None,
) -> Iterator[Claim]:
    """Hold path as this command's (see the module docstring)."""
    path = Path(path)
    outer = _active.get(os.path.realpath(path))
    if outer is not None:  # this process holds it already: the caller fills it, the outer claim decides
        found = Found(path, Kind.MAKING, read_mark(path))
        yield Claim(path, command, found, outer.token, False, inner=True, layout=outer.layout)
        return
    if within is not None:
        _no_links(path, within, label)  # before recognise: lstat would follow a linked parent
    found = recognise(path, legacy, layout)
    if refused(found):
        raise refusal(found, label)  # before the lock: nothing is written into another's folder
    made = _make_dir(path, label, within)
    removed = False
    try:
        with _folder_lock(path, command, mode, label) as lock:
            try:
                owned = _take(path, command, legacy, layout, label, made)
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
