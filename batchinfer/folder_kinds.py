"""What a folder is to a command that wants it: the reading side of ownership.py, which alone
writes and removes (the one home of folders). A folder's owner's mark (MARK), the names a command
makes in its folder (Layout), what recognise found there (Found, Kind), and the one-line refusal
of a folder a command may not take. Writes and removes nothing."""

from __future__ import annotations

import fnmatch
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Optional, TypedDict

from batchinfer.durable import read_json
from batchinfer.errors import FolderRefused
from batchinfer.locks.holder import Holder, HolderRecord, Judgement, Verdict
from batchinfer.locks.judge import judge_holder

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


def others(folder: Path) -> list[str]:
    """The folder's names that are not ours (the mark, the lock, their temporaries, lock probes)."""
    return sorted(n for n in os.listdir(folder) if _OURS not in n and not n.startswith(_PROBES))


@dataclass(frozen=True)
class Layout:
    """What a command makes at the top of its folder: fnmatch patterns (`output.*`, `.tmp-*`). Only
    these names are removed from a folder it made; any other name there is someone else's."""

    what: str  # "a run directory being prepared", for refusals
    names: tuple[str, ...]

    def makes(self, name: str) -> bool:
        """Whether the command makes a name like this one."""
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.names)

    def strays(self, folder: Path) -> list[str]:
        """The folder's names (beside the mark and the lock) the command never makes."""
        return [n for n in others(folder) if not self.makes(n)]


def shown(names: list[str]) -> str:
    """Up to 8 names, for one-line messages."""
    return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")


@dataclass(frozen=True)
class Found:
    """What recognise saw at path: its kind, its mark, and why (the maker's judgement, the names);
    judged: the maker's verdict (MAKING: alive, or not judgeable from here); strays: a half-made
    folder's names its layout does not make."""

    path: Path
    kind: Kind
    mark: Optional[Mark] = None
    why: str = ""
    judged: Optional[Judgement] = None
    strays: tuple[str, ...] = ()


def recognise(
    path: Path, legacy: Optional[Callable[[Path], Optional[Kind]]] = None, layout: Optional[Layout] = None
) -> Found:
    """What path is to a command that wants it (see the module docstring)."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return Found(path, Kind.ABSENT)
    if not stat.S_ISDIR(st.st_mode):
        return Found(path, Kind.NOT_A_FOLDER, why="a symlink" if stat.S_ISLNK(st.st_mode) else "a file")
    mark = read_mark(path)
    strays = tuple(layout.strays(path)) if layout else ()
    if mark is not None:
        if mark.state is State.DONE:
            return Found(path, Kind.DONE, mark)
        judged = judge_holder(mark.maker)
        if judged.verdict is not Verdict.DEAD:
            return Found(path, Kind.MAKING, mark, judged.why, judged)
        return Found(path, Kind.HALF_MADE, mark, judged.why, judged, strays)
    names = others(path)
    if not names:
        return Found(path, Kind.EMPTY)
    kind = legacy(path) if legacy else None
    if kind is Kind.HALF_MADE and strays:  # no mark says when they came: never take them for ours
        return Found(path, Kind.FOREIGN, why=shown(list(strays)))
    if kind in (Kind.DONE, Kind.HALF_MADE):
        return Found(path, kind, why="made by an older batchinfer")
    return Found(path, Kind.FOREIGN, why=shown(names))


def refusal(found: Found, label: str = "") -> FolderRefused:
    """The one-line refusal of a folder a command may not take."""
    where = f"{label} {found.path}" if label else str(found.path)
    if found.kind is Kind.NOT_A_FOLDER:
        return FolderRefused(f"{where} is {found.why}, not a folder; choose another")
    if found.kind is Kind.MAKING and found.mark is not None:
        judged = found.judged
        if judged is None or judged.verdict is Verdict.ALIVE:
            return FolderRefused(
                f"{where} is being made by {found.mark.describe()}: {found.why}; wait for it or choose another folder"
            )
        if judged.slurm_silent:
            return FolderRefused(
                f"{where} is being made by {found.mark.describe()}; Slurm did not answer ({found.why}), so it is "
                f"not taken over: try again later"
            )
        return FolderRefused(
            f"{where} is being made by {found.mark.describe()}, which cannot be checked from here ({found.why}); "
            f"if that process is gone, remove {found.path} by hand (it is half made: nothing in it is finished) "
            f"and run the same command again, else wait for it or choose another folder"
        )
    if found.kind is Kind.HALF_MADE and found.strays and found.mark is not None:
        return FolderRefused(
            f"{where} was left half made by {found.mark.describe()}, whose process is gone, and it holds "
            f"{shown(list(found.strays))}, which batchinfer {found.mark.command} never makes there; taking it "
            f"over would remove what that command left, never these: move them out of {found.path} (or choose "
            f"another folder) and run the same command again"
        )
    if found.kind is Kind.FOREIGN:
        return FolderRefused(
            f"{where} is not empty and batchinfer did not make it (it holds {found.why}); batchinfer never "
            f"writes into or clears a folder it did not make: choose a new or empty folder"
        )
    return FolderRefused(f"{where} is {found.kind.value}; choose another folder")


def refused(found: Found) -> bool:
    """Whether a claim may not take what recognise found."""
    half_made_with_strays = found.kind is Kind.HALF_MADE and bool(found.strays)
    return found.kind in (Kind.NOT_A_FOLDER, Kind.FOREIGN, Kind.MAKING) or half_made_with_strays
