"""The other nodes of a task whose engine spans several nodes (cluster.nodes_per_task): this
process (the worker on the allocation's first node, the only writer of the run directory) starts
their engine ranks as one `srun` step of its own job and ends that step itself.

Why an `srun` step started here, not submitit starting the function on every node: the worker
keeps being the one process of its step, exactly as with one node (its signals, requeue and
single-writer rules are unchanged), and it owns the ranks' lifetime: it stops them when it is done
or stopped (vLLM's headless ranks do not exit when the head does), and a rank that dies ends the
step it watches. If the worker itself dies, its step ends, the job's batch script ends with it and
Slurm ends every step of the job on every node (KillWait). Why not Ray: vLLM's mp backend spans
nodes without it (`vllm serve --headless`), and a Ray cluster per task would be one more runtime
to start, watch and stop inside the allocation."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, Optional

from batchinfer import slurm_env
from batchinfer.config.nodes import NodeGroup
from batchinfer.engine.dtype import settle
from batchinfer.errors import ConfigError
from batchinfer.launch import slurm
from batchinfer.launch.executor import STEP_BOOT
from batchinfer.rundir.store import RunDir

log = logging.getLogger("batchinfer")
Resolve = Callable[[Any, str, NodeGroup], dict[str, Any]]  # (config, dtype, group) -> engine arguments
PORT_BASE = 29500  # + job id % 1000: two tasks sharing nodes start apart
PORT_TRIES = 50  # ports tried upward from there while the one tried is taken
STOP_WAIT_S = 30.0  # the ranks get this long to exit after TERM before they are killed
# A rank step that ends on its own is acted on after this pause: a stop signal delivered to the
# whole job (scancel) reaches this process too, and decides first.
RANK_EXIT_GRACE_S = 3.0
# An engine that failed while its ranks' step is still up waits this long for the step to end before
# the rows in flight are charged: a lost node often fails the head's engine (its collective cut off)
# before `srun` has noticed and ended the step.
NODE_FAULT_WAIT_S = 15.0
# + DIR ADDR PORT NNODES DTYPE ENGINE_ARGS. USR2 blocked by the interpreter's first statement (STEP_BOOT,
# as the head's step): Slurm signals every step of the job, and a notice while the rank's Python still
# imports batchinfer would kill the rank by USR2's default action (seen: a rank killed 3 s after its srun).
HEADLESS = [sys.executable, "-u", "-c", STEP_BOOT, "-m", "batchinfer.engine.headless"]


def allocation_nodes() -> list[str]:
    """The job's nodes in Slurm's order (`scontrol show hostnames $SLURM_JOB_NODELIST`)."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodelist:
        raise ConfigError("cluster.nodes_per_task > 1 runs only as a Slurm job (no SLURM_JOB_NODELIST)")
    res = slurm.run_command(["scontrol", "show", "hostnames", nodelist])
    if res.returncode != 0:
        raise ConfigError(f"scontrol show hostnames {nodelist}: {slurm.first_error_line(res.stderr)}")
    return res.stdout.split()


def free_port(addr: str, job_id: int) -> int:
    """The first port from PORT_BASE + job id % 1000 upward that nothing listens on at addr."""
    first = PORT_BASE + job_id % 1000
    for port in range(first, first + PORT_TRIES):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((addr, port))
            except OSError as e:
                if e.errno != errno.EADDRINUSE:
                    raise
                continue
        return port
    raise ConfigError(f"ports {first}-{first + PORT_TRIES - 1} at {addr} are all taken; no port for the engine")


def meeting_point(head: str, nnodes: int) -> NodeGroup:
    """Where this job's nodes meet: the head node's address and a port from this job's id (each
    array task has its own) that nothing on the head listens on now."""
    addr = socket.gethostbyname(head)
    job = slurm_env.current().job_id or "0"
    return NodeGroup(nnodes=nnodes, master_addr=addr, master_port=free_port(addr, int(job)))


class RankStep:
    """The `srun` step of the other nodes' engine ranks, watched by a thread: if it ends before
    stop(), this node's engine processes are killed, so the engine fails here (a failure counted,
    the task requeued while cluster.max_attempts allows) instead of waiting for a rank that is gone."""

    def __init__(self, run: RunDir, nodes: list[str], head: str, resolve: Optional[Resolve] = None):
        """resolve: the engine arguments the head runs with (head_defaults), for every node alike."""
        self.others = [n for n in nodes if n != head]
        dtype = settle(run.path, run.config.model.dtype)
        group = meeting_point(head, len(nodes))
        self.group = dataclasses.replace(group, engine_args=resolve(run.config, dtype, group) if resolve else {})
        addr = self.group.master_addr
        n = len(self.others)
        self.cmd = [
            "srun",
            f"--nodes={n}",
            f"--ntasks={n}",
            "--ntasks-per-node=1",
            f"--nodelist={','.join(self.others)}",
            "--kill-on-bad-exit=1",
            "--unbuffered",
            *HEADLESS,
            str(run.path),
            addr,
            str(self.group.master_port),
            str(self.group.nnodes),
            str(dtype),
            json.dumps(self.group.engine_args),
        ]
        self.proc: Optional[subprocess.Popen] = None
        self.stopping = threading.Event()
        self.died: Optional[str] = None  # why the step ended on its own
        self._watcher = threading.Thread(target=self._watch, name="rank-step", daemon=True)

    def start(self) -> None:
        """Start the step; its tasks wait for the head's engine to meet them."""
        log.info(
            "engine over %d nodes: ranks of nodes %s started, meeting at %s:%d",
            self.group.nnodes,
            ",".join(self.others),
            self.group.master_addr,
            self.group.master_port,
        )
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL)
        self._watcher.start()

    def _watch(self) -> None:
        assert self.proc is not None
        rc = self.proc.wait()
        if self.stopping.wait(RANK_EXIT_GRACE_S):
            return
        self.died = self._exited(rc)
        log.error("%s: stopping this node's engine, so the engine fails here", self.died)
        kill_engine_processes(exclude=self.proc.pid)

    def fault(self) -> Optional[str]:
        """Why the engine failed when its cause is another node: the ranks' step ended on its own
        (waited for up to NODE_FAULT_WAIT_S); None when the ranks live on, or were stopped."""
        if self.proc is None or self.stopping.is_set():
            return None
        try:
            rc = self.proc.wait(NODE_FAULT_WAIT_S)
        except subprocess.TimeoutExpired:
            return None
        return None if self.stopping.is_set() else self._exited(rc)

    def _exited(self, rc: int) -> str:
        return f"the engine ranks on {','.join(self.others)} exited (srun exit status {rc})"

    def stop(self) -> None:
        """End the step: TERM (srun passes it to every rank), KILL after STOP_WAIT_S."""
        self.stopping.set()
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            log.warning("the engine ranks on %s did not stop within %g s: killing them", self.others, STOP_WAIT_S)
            self.proc.kill()
            self.proc.wait()
        log.info("the engine ranks on %s have stopped", ",".join(self.others))


def kill_engine_processes(exclude: int) -> None:
    """SIGKILL this process's descendants (its engine's processes) but the process `exclude`."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        if child.pid == exclude:
            continue
        with contextlib.suppress(psutil.Error):
            child.kill()


@contextlib.contextmanager
def other_ranks(run: RunDir) -> Iterator[Optional[RankStep]]:
    """With cluster.nodes_per_task > 1: the other nodes' ranks running (their step; its group is
    for this node's engine); they are stopped on the way out, however it is left. None for one node."""
    n = run.config.cluster.nodes_per_task
    if n == 1:
        yield None
        return
    here = os.environ.get("SLURMD_NODENAME")
    nodes = allocation_nodes()
    if len(nodes) != n or here not in nodes:
        raise ConfigError(
            f"cluster.nodes_per_task={n}, but this job has {len(nodes)} node(s) ({','.join(nodes)}) and runs on "
            f"{here}: submit it with `batchinfer submit` (or sbatch --nodes={n} --ntasks-per-node=1)"
        )
    from batchinfer.engine.vllm_engine import head_defaults  # the worker's process runs vLLM anyway

    step = RankStep(run, nodes, here, head_defaults)
    step.start()
    try:
        yield step
    finally:
        step.stop()
