"""Slurm's commands faked on PATH for the launch tests (no cluster)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support.fake_slurm import fake_slurm_bin


@pytest.fixture
def fake_bin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """fake(name, body) writes a shell script named name first on PATH (support.fake_slurm)."""
    return fake_slurm_bin(tmp_path, monkeypatch)
