"""Every test here runs on a dev cluster (slurm/dev/up.sh), brought up once per module: the one-node
cluster, or the two-node one for modules marked `two_nodes`."""

from __future__ import annotations

import pytest
from support.slurm import use_dev_cluster
from support.two_nodes import TwoNodeCluster, two_node_cluster


@pytest.fixture(scope="module", autouse=True)
def slurm_env(request: pytest.FixtureRequest) -> dict[str, str]:
    """The one-node dev cluster, up (in CI a test that cannot reach it fails: up.sh's failure is
    asserted); nothing for a two-node module, whose tests take `cluster` instead."""
    if request.node.get_closest_marker("two_nodes"):
        return {}
    return use_dev_cluster()


@pytest.fixture(scope="module")
def cluster() -> TwoNodeCluster:
    """The two-node dev cluster (node1, node2), up."""
    return two_node_cluster()
