"""The two-node dev cluster (SLURM_DEV_NODES=2 slurm/dev/up.sh): bring it up, submit to it, and find
a job's processes on each of its nodes (each node's slurmd runs in its own network namespace)."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from support import REPO

NODES = ("node1", "node2")


@dataclass(frozen=True)
class TwoNodeCluster:
    """A running two-node dev cluster: the client environment and its state folder."""

    env: dict[str, str]
    state: Path

    def run(self, *cmd: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster (never the one-node cluster)."""
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=self.env)

    def sbatch(self, script: Path, *args: str, timeout: float = 60) -> str:
        """Submit script with these sbatch options; the job id."""
        res = self.run("sbatch", "--parsable", *args, str(script), timeout=timeout)
        assert res.returncode == 0, res.stderr
        return res.stdout.strip().split(";")[0]

    def wait_done(self, job: str, timeout: float = 120) -> None:
        """Until job has left the queue (polled; `sbatch --wait` backs off to 30 s between polls)."""
        wait_until(lambda: not self.run("squeue", "-h", "-j", job, "-o", "%i").stdout.strip(), timeout, f"job {job}")

    def node_addr(self, node: str) -> str:
        """The address slurm.conf gives node (its NodeAddr on the bridge)."""
        res = self.run("scontrol", "show", "node", node, "-o")
        fields = dict(f.split("=", 1) for f in res.stdout.split() if "=" in f)
        return fields["NodeAddr"]

    def node_netns(self) -> dict[str, str]:
        """Each node's network namespace (`net:[inode]`), read from its slurmd's pidfile."""
        spaces = {}
        for node in NODES:
            pid = (self.state / "run" / f"slurmd-{node}.pid").read_text().strip()
            spaces[os.readlink(f"/proc/{pid}/ns/net")] = node
        return spaces

    def job_processes(self, job: str) -> dict[str, list[str]]:
        """Processes of job still alive, per node: `pid comm` of each slurmstepd of the job and each
        process whose environment carries SLURM_JOB_ID=job (zombies do not count)."""
        spaces = self.node_netns()
        found: dict[str, list[str]] = {}
        mark = f"SLURM_JOB_ID={job}".encode()
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                net = os.readlink(f"/proc/{pid}/ns/net")
            except OSError:
                continue
            comm, state = stat[stat.index("(") + 1 : stat.rindex(")")], stat.rpartition(")")[2].split()[0]
            ours = cmdline.startswith(f"slurmstepd: [{job}.".encode()) or mark in environ
            if ours and state != "Z":
                found.setdefault(spaces.get(net, f"not a node ({net})"), []).append(f"{pid} {comm}")
        return found


def two_node_cluster() -> TwoNodeCluster:
    """Bring the two-node cluster up (idempotent) and return its client environment; the one-node
    cluster is neither touched nor used. Fails (never skips) when up.sh fails."""
    res = subprocess.run(
        ["bash", str(REPO / "slurm/dev/up.sh")],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, SLURM_DEV_NODES="2"),
    )
    assert res.returncode == 0, f"SLURM_DEV_NODES=2 slurm/dev/up.sh failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}"
    env_sh = Path(res.stdout.strip().splitlines()[-1].removeprefix("source ").strip())
    env = dict(os.environ)
    for line in env_sh.read_text().splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        env[key] = os.path.expandvars(value.replace('"$PATH"', env.get("PATH", "")))
    cluster = TwoNodeCluster(env=env, state=env_sh.parent)
    ping = cluster.run("scontrol", "ping")
    assert "UP" in ping.stdout, ping.stdout + ping.stderr
    return cluster


def wait_until(cond: Callable[[], object], timeout: float, what: str) -> None:
    """Poll cond every 0.5 s; fail naming what was awaited when timeout passes first."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)
