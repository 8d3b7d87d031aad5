"""Every test here runs on the dev cluster (slurm/dev/up.sh), brought up once per module."""

from __future__ import annotations

import pytest
from support.slurm import use_dev_cluster


@pytest.fixture(scope="module", autouse=True)
def slurm_env() -> dict[str, str]:
    """The dev cluster, up (in CI a test that cannot reach it fails: up.sh's failure is asserted)."""
    return use_dev_cluster()
