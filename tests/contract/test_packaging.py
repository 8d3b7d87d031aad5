"""The wheel ships conf/ as batchinfer/conf, so an installed batchinfer composes its configs."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from support import REPO


def test_wheel_contains_conf(tmp_path: Path) -> None:
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(REPO),
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            "-q",
        ],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    (wheel,) = tmp_path.glob("batchinfer-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {p.relative_to(REPO).as_posix() for p in (REPO / "conf").rglob("*.yaml")}
    assert expected and {"conf/config.yaml", "conf/sampling/greedy.yaml", "conf/cluster/local.yaml"} <= expected
    assert {"batchinfer/" + e for e in expected} <= names
    assert "batchinfer/conf/__init__.py" in names and "batchinfer/cli.py" in names
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "batchinfer = batchinfer.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()
