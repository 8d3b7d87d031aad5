"""The process's mount table (/proc/self/mountinfo): which filesystem holds a path, and how it is mounted."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

MOUNTINFO = Path("/proc/self/mountinfo")


@dataclass(frozen=True)
class Mount:
    """One mountinfo line: the root inside the filesystem, the mount point, the type, every option."""

    root: str
    point: str
    fstype: str
    options: frozenset[str]  # per-mount options and the filesystem's own (super) options together


def _unescape(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash in paths as octal escapes (\040 ...).
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def read_mounts(path: Path = MOUNTINFO) -> list[Mount]:
    """Every mount of a mountinfo file, in its order (a later line overmounts an earlier one); [] if unreadable."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        left, sep, right = line.partition(" - ")  # optional fields end at " - "
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 6 or len(tail) < 1:
            continue
        options = set(fields[5].split(",")) | set((tail[2] if len(tail) > 2 else "").split(","))
        out.append(Mount(_unescape(fields[3]), _unescape(fields[4]), tail[0], frozenset(options - {""})))
    return out


def mount_of(target: Path, mounts: list[Mount]) -> Mount | None:
    """The mount holding a path: the longest mount point above it, the last such line when stacked."""
    resolved = str(target.resolve())
    best = None
    for m in mounts:
        inside = resolved == m.point or resolved.startswith(m.point.rstrip("/") + "/")
        if inside and (best is None or len(m.point) >= len(best.point)):
            best = m
    return best
