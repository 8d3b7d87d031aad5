"""The CPUs this process may use: its affinity mask and its cgroup CPU quota, not os.cpu_count().

Login nodes limit each user (a cpuset, or systemd's CPUQuota on the user's slice), and a Slurm
step binds its tasks; os.cpu_count() says how many the machine has, which overloads them."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Optional

from batchinfer.mounts import read_mounts

PROC = Path("/proc/self")


def _mounts(proc: Path) -> list[tuple[str, Path, str, set[str]]]:
    """cgroup mounts of mountinfo: (root inside the hierarchy, mount point, fstype, options)."""
    return [
        (m.root, Path(m.point), m.fstype, set(m.options))
        for m in read_mounts(proc / "mountinfo")
        if m.fstype in ("cgroup", "cgroup2")
    ]


def _memberships(proc: Path) -> list[tuple[set[str], str]]:
    """/proc/self/cgroup as (controllers, path); cgroup v2's line has no controllers."""
    try:
        lines = (proc / "cgroup").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3:
            out.append((set(parts[1].split(",")) - {""}, parts[2]))
    return out


def _ancestors(mount_root: str, mount_point: Path, path: str) -> list[Path]:
    """The process's cgroup folder under a mount point and every parent up to the mount point:
    a limit set on a parent (a user's slice) binds every cgroup below it."""
    root = mount_root.rstrip("/")
    if mount_root == "/" or path == root or path.startswith(root + "/"):
        rel = path[len(root) :] if mount_root != "/" else path
    else:  # a cgroup namespace shows the process at "/": its own cgroup is the mount point
        rel = ""
    folder = mount_point / rel.strip("/")
    chain = [folder]
    while folder != mount_point and folder.parent != folder:
        folder = folder.parent
        chain.append(folder)
    return chain


def _read(path: Path) -> Optional[str]:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _ratio(quota: Optional[str], period: Optional[str]) -> Optional[float]:
    try:
        q, p = int(quota or ""), int(period or "")
    except ValueError:  # "max" (v2) or no file: no limit here
        return None
    return q / p if q > 0 and p > 0 else None  # v1 writes -1 for no limit


def _v2_limit(folder: Path) -> Optional[float]:
    parts = (_read(folder / "cpu.max") or "").split()  # "quota period" or "max period"
    return _ratio(*parts) if len(parts) == 2 else None


def _v1_limit(folder: Path) -> Optional[float]:
    return _ratio(_read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us"))


def cgroup_cpu_limit(proc: Path = PROC) -> Optional[float]:
    """The tightest CPU quota (in CPUs, e.g. 1.5) of the cgroups holding this process, v2 or v1; None: no quota."""
    mounts = _mounts(proc) or [
        ("/", Path("/sys/fs/cgroup"), "cgroup2", set()),
        ("/", Path("/sys/fs/cgroup/cpu"), "cgroup", {"cpu"}),
    ]
    limits = []
    for controllers, path in _memberships(proc):
        for root, point, fstype, options in mounts:
            if controllers and fstype == "cgroup" and "cpu" in controllers and "cpu" in options:
                limits += [_v1_limit(d) for d in _ancestors(root, point, path)]
            elif not controllers and fstype == "cgroup2":
                limits += [_v2_limit(d) for d in _ancestors(root, point, path)]
    found = [x for x in limits if x is not None]
    return min(found) if found else None


def allowed_cpus(proc: Path = PROC) -> int:
    """CPUs this process may use: the affinity mask and the cgroup quota (rounded up), the smaller, at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity call (macOS)
        cpus = os.cpu_count() or 1
    limit = cgroup_cpu_limit(proc)
    # Rounded up, as the JVM and Go do: 1.5 CPUs of quota keep 2 processes busy 75% of the time each.
    if limit is not None:
        cpus = min(cpus, math.ceil(limit))
    return max(1, cpus)
