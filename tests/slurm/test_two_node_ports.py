"""Two tasks on the same two nodes do not take each other's ports (launch/ranks.meeting_point, the
port an engine over several nodes meets at): on the two-node dev cluster, jobs sharing both nodes
(--oversubscribe) each choose their port on the head node as the worker does and hold it, as the
engine's head holds it. No engine: the port choice and the bind are what is proven.

The port starts at PORT_BASE + job id % 1000, so tasks of consecutive ids start apart; they meet
when one was pushed up: job A finds its first port taken on the head (by another job there) and
moves to the next one, which is job B's first port. B must then pass over it too."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from support import REPO
from support.two_nodes import TwoNodeCluster, wait_until

from batchinfer.launch.ranks import PORT_BASE

pytestmark = [pytest.mark.slurm, pytest.mark.two_nodes]

# A task's stand-in: the head node's address and a port as the worker chooses them
# (ranks.meeting_point) or, given a port, that port; held (listening) until OUT/release appears.
HOLD = r"""
import json, os, socket, sys, time
from pathlib import Path
from batchinfer.launch import ranks
out, name = Path(sys.argv[1]), sys.argv[2]
nodes = ranks.allocation_nodes()
if len(sys.argv) > 3:
    addr, port = socket.gethostbyname(nodes[0]), int(sys.argv[3])
else:
    group = ranks.meeting_point(nodes[0], len(nodes))
    addr, port = group.master_addr, group.master_port
srv = socket.create_server((addr, port))  # fails if another job on this node holds it
job = os.environ["SLURM_JOB_ID"]
rec = {"job": job, "node": os.environ["SLURMD_NODENAME"], "nodes": nodes, "addr": addr, "port": port}
(out / f".{name}").write_text(json.dumps(rec))
os.rename(out / f".{name}", out / f"{name}.json")
deadline = time.monotonic() + 180
while not (out / "release").exists() and time.monotonic() < deadline:
    time.sleep(0.2)
"""


def submit_holder(cluster: TwoNodeCluster, tmp: Path, name: str, *args: str, held: bool = False) -> str:
    """A job on both nodes, sharing them, running HOLD on the first; its job id."""
    script = tmp / f"{name}.sh"
    script.write_text(
        f"#!/bin/bash\nexport PYTHONPATH={REPO}\nexec {sys.executable} {tmp / 'hold.py'} {tmp / 'out'} {name} {' '.join(args)}\n"
    )
    options = ["--nodes=2", "--ntasks-per-node=1", "--oversubscribe", f"--output={tmp / name}.log"]
    return cluster.sbatch(script, *options, *(["--hold"] if held else []))


def record(tmp: Path, name: str) -> dict:
    return json.loads((tmp / "out" / f"{name}.json").read_text())


@pytest.mark.timeout(300)
def test_two_tasks_on_the_same_nodes_take_different_ports(cluster: TwoNodeCluster, tmp_path: Path) -> None:
    (tmp_path / "hold.py").write_text(HOLD)
    (tmp_path / "out").mkdir()
    jobs: list[str] = []
    try:
        a = submit_holder(cluster, tmp_path, "a", held=True)
        b = submit_holder(cluster, tmp_path, "b", held=True)
        jobs += [a, b]
        assert int(b) == int(a) + 1, f"jobs {a} and {b}: another submission came between them"
        first_a, first_b = PORT_BASE + int(a) % 1000, PORT_BASE + int(b) % 1000
        assert first_b == first_a + 1
        # another job on the same nodes holds A's first port on the head node
        jobs.append(submit_holder(cluster, tmp_path, "other", str(first_a)))
        wait_until(lambda: (tmp_path / "out/other.json").exists(), 120, "the other job holding its port")
        cluster.run("scontrol", "release", a)
        wait_until(lambda: (tmp_path / "out/a.json").exists(), 120, "job A holding its port")
        cluster.run("scontrol", "release", b)
        wait_until(lambda: (tmp_path / "out/b.json").exists(), 120, "job B holding its port")
        other, ra, rb = record(tmp_path, "other"), record(tmp_path, "a"), record(tmp_path, "b")
    finally:
        (tmp_path / "out/release").touch()  # the holders end; a job still held is cancelled
        cluster.run("scancel", "--state=PENDING", *jobs)
        for job in jobs:
            cluster.wait_done(job, timeout=90)
    # all three at once on the same two nodes, the ports on the head node's address
    assert [r["job"] for r in (ra, rb)] == [a, b]
    assert other["nodes"] == ra["nodes"] == rb["nodes"] == ["node1", "node2"]
    assert other["node"] == ra["node"] == rb["node"] == "node1"
    assert other["addr"] == ra["addr"] == rb["addr"] == cluster.node_addr("node1")
    # A found its first port taken and moved up, onto B's first port; B, finding A there, moved on
    assert other["port"] == first_a and ra["port"] == first_a + 1 == first_b
    assert rb["port"] == first_b + 1
    assert len({other["port"], ra["port"], rb["port"]}) == 3  # each held its own, at the same time
