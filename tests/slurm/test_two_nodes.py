"""The two-node dev cluster (SLURM_DEV_NODES=2 slurm/dev/up.sh), what an engine spanning two nodes
needs from it: one step per node, the steps meet over TCP at the head node's address, scancel leaves
nothing on either node, and a requeued 2-node job runs again on both nodes. No engine here."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from support.two_nodes import NODES, TwoNodeCluster, wait_until

pytestmark = [pytest.mark.slurm, pytest.mark.two_nodes]

# Rank 0 listens on the head node's address (resolved from the allocation's node list, as an
# engine's head would), rank 1 connects to it and both report what they saw.
MEET = r"""
import os, socket, sys, time
head, port = sys.argv[1], int(sys.argv[2])
rank, me = int(os.environ["SLURM_PROCID"]), os.environ["SLURMD_NODENAME"]
addr = socket.gethostbyname(head)
if rank == 0:
    srv = socket.create_server((addr, port))
    srv.settimeout(60)
    conn, peer = srv.accept()
    got = conn.recv(100).decode()
    conn.sendall(f"hello from {me}".encode())
    print(f"MEET rank=0 node={me} listened={addr}:{port} got={got} peer={peer[0]}", flush=True)
else:
    deadline = time.monotonic() + 60
    while True:
        try:
            conn = socket.create_connection((addr, port), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    conn.sendall(me.encode())
    got = conn.recv(100).decode()
    print(f"MEET rank=1 node={me} connected={conn.getsockname()[0]} got={got}", flush=True)
"""


def write_script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/bash\nset -euo pipefail\n" + body)
    return path


def cancel(cluster: TwoNodeCluster, job: str) -> None:
    cluster.run("scancel", job)


def test_a_step_on_each_node_and_the_steps_meet_over_tcp(cluster: TwoNodeCluster, tmp_path: Path) -> None:
    (tmp_path / "meet.py").write_text(MEET)
    script = write_script(
        tmp_path / "job.sh",
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)\n'
        "srun bash -c 'echo ID $SLURMD_NODENAME $SLURM_NODEID $SLURM_PROCID $(hostname) $(hostname -I)'\n"
        f'srun {sys.executable} {tmp_path / "meet.py"} "$head" $(( 20000 + SLURM_JOB_ID % 10000 ))\n',
    )
    out = tmp_path / "job.out"
    job = cluster.sbatch(script, "--nodes=2", "--ntasks-per-node=1", f"--output={out}")
    cluster.wait_done(job)
    text = out.read_text()
    addr = {node: cluster.node_addr(node) for node in NODES}
    ids = sorted(tuple(line.split()[1:]) for line in text.splitlines() if line.startswith("ID "))
    # each step runs on its own node: its hostname and its only address are that node's
    assert ids == [("node1", "0", "0", "node1", addr["node1"]), ("node2", "1", "1", "node2", addr["node2"])], text
    assert addr["node1"] != addr["node2"]
    meet = sorted(line for line in text.splitlines() if line.startswith("MEET "))
    port = 20000 + int(job) % 10000
    assert meet == [
        f"MEET rank=0 node=node1 listened={addr['node1']}:{port} got=node2 peer={addr['node2']}",
        f"MEET rank=1 node=node2 connected={addr['node2']} got=hello from node1",
    ], text


def test_scancel_leaves_no_process_of_the_job_on_either_node(cluster: TwoNodeCluster, tmp_path: Path) -> None:
    script = write_script(tmp_path / "job.sh", "srun sleep 600\n")
    job = cluster.sbatch(script, "--nodes=2", "--ntasks-per-node=1", f"--output={tmp_path / 'job.out'}")
    try:

        def sleeping_on_both() -> bool:
            procs = cluster.job_processes(job)
            return all(any(p.endswith(" sleep") for p in procs.get(node, [])) for node in NODES)

        wait_until(sleeping_on_both, 60, f"job {job}'s sleep on both nodes")
        before = cluster.job_processes(job)
        assert set(before) == set(NODES), before
    finally:
        cancel(cluster, job)
    wait_until(lambda: not cluster.job_processes(job), 60, f"no process of job {job} left")
    assert cluster.job_processes(job) == {}


def test_requeue_runs_a_two_node_job_again_on_two_nodes(cluster: TwoNodeCluster, tmp_path: Path) -> None:
    runs = tmp_path / "runs.txt"
    script = write_script(
        tmp_path / "job.sh",
        f"srun bash -c 'echo RUN ${{SLURM_RESTART_COUNT:-0}} $SLURMD_NODENAME $SLURM_JOB_NUM_NODES' >> {runs}\n"
        "sleep 600\n",
    )
    job = cluster.sbatch(script, "--requeue", "--nodes=2", "--ntasks-per-node=1", f"--output={tmp_path / 'job.out'}")

    def run_lines() -> list[str]:
        return sorted(runs.read_text().splitlines()) if runs.exists() else []

    try:
        wait_until(lambda: len(run_lines()) == 2, 60, f"job {job}'s first run on both nodes")
        res = cluster.run("scontrol", "requeue", job)
        assert res.returncode == 0, res.stderr
        wait_until(lambda: len(run_lines()) == 4, 120, f"job {job}'s second run on both nodes")
        assert run_lines() == ["RUN 0 node1 2", "RUN 0 node2 2", "RUN 1 node1 2", "RUN 1 node2 2"]
        state = cluster.run("squeue", "-h", "-j", job, "-o", "%T %D %N").stdout.split()
        assert state == ["RUNNING", "2", "node[1-2]"], state
        restarts = cluster.run("scontrol", "show", "job", job).stdout
        assert re.search(r"\bRestarts=1\b", restarts), restarts
    finally:
        cancel(cluster, job)
