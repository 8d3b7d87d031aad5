"""The head of an engine over several nodes (launch/ranks.py) without a cluster: the port taken
from the job id and checked free, the arguments each node's engine gets, and a refused layout."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from support.fake_engine import prepared

from batchinfer.config.nodes import RANK_WORKER, NodeGroup, node_kwargs
from batchinfer.errors import ConfigError
from batchinfer.launch import ranks


def test_the_port_comes_from_the_job_id_and_a_taken_one_is_passed_over() -> None:
    first = ranks.PORT_BASE + 4321 % 1000
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", first))
        taken.listen()
        assert ranks.free_port("127.0.0.1", 4321) == first + 1
    assert ranks.free_port("127.0.0.1", 4321) == first  # free again
    assert ranks.free_port("127.0.0.1", 4322) == first + 1  # another task's job id: another port


def test_each_node_gets_its_rank_and_the_head_address() -> None:
    group = NodeGroup(nnodes=2, master_addr="10.0.0.1", master_port=29510, engine_args={"max_num_batched_tokens": 8192})
    assert node_kwargs(group) == {
        "max_num_batched_tokens": 8192,  # what the head resolved, on every node alike
        "worker_cls": RANK_WORKER,  # a worker whose step raised exits: its node's step ends
        "nnodes": 2,
        "node_rank": 0,
        "master_addr": "10.0.0.1",
        "master_port": 29510,
        "distributed_executor_backend": "mp",
    }
    assert node_kwargs(group, 1)["node_rank"] == 1 and node_kwargs(group, 1)["max_num_batched_tokens"] == 8192
    assert node_kwargs(None) == {} and node_kwargs(NodeGroup(1, "x", 1)) == {}


def test_the_rank_step_runs_on_the_other_nodes_only(tmp_path: Path, monkeypatch) -> None:
    run = prepared(
        tmp_path,
        4,
        "cluster=slurm",
        "cluster.gpus_per_task=0",
        "cluster.nodes_per_task=3",
        "model.tensor_parallel_size=3",
    )
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setattr(socket, "gethostbyname", lambda node: "127.0.0.1")
    resolved = {"max_num_batched_tokens": 8192, "max_num_seqs": 768, "enable_chunked_prefill": True}
    asked = []

    def resolve(cfg, dtype, group):
        asked.append((dtype, group))
        return resolved

    step = ranks.RankStep(run, ["n1", "n2", "n3"], "n2", resolve)
    assert step.others == ["n1", "n3"]
    assert step.group == NodeGroup(nnodes=3, master_addr="127.0.0.1", master_port=ranks.PORT_BASE + 77)
    assert step.group.engine_args == resolved and asked == [(step.cmd[-2], step.group)]
    assert step.cmd[:7] == [
        "srun",
        "--nodes=2",
        "--ntasks=2",
        "--ntasks-per-node=1",
        "--nodelist=n1,n3",
        "--kill-on-bad-exit=1",
        "--unbuffered",
    ]
    # DIR, the head's address and port, the nodes, the dtype settled for the run (DIR/dtype.json)
    # and the engine arguments the head resolved
    assert step.cmd[-6:-2] == [str(run.path), "127.0.0.1", str(ranks.PORT_BASE + 77), "3"]
    assert step.cmd[-2] == json.loads((run.path / "dtype.json").read_text())["dtype"]
    assert json.loads(step.cmd[-1]) == resolved


def test_a_job_without_the_nodes_it_asks_for_is_refused(tmp_path: Path, monkeypatch) -> None:
    run = prepared(
        tmp_path,
        4,
        "cluster=slurm",
        "cluster.gpus_per_task=0",
        "cluster.nodes_per_task=2",
        "model.tensor_parallel_size=2",
    )
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    monkeypatch.delenv("SLURM_NODELIST", raising=False)
    with pytest.raises(ConfigError, match="runs only as a Slurm job"):
        with ranks.other_ranks(run):
            pass
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n1")
    monkeypatch.setenv("SLURMD_NODENAME", "n1")
    monkeypatch.setattr(ranks, "allocation_nodes", lambda: ["n1"])
    with pytest.raises(ConfigError, match=r"cluster.nodes_per_task=2, but this job has 1 node\(s\) \(n1\)"):
        with ranks.other_ranks(run):
            pass


def rank_step(tmp_path: Path, monkeypatch, cmd: list[str]) -> ranks.RankStep:
    """A RankStep whose `srun` is cmd (no cluster): what it does when that process ends is the point."""
    run = prepared(
        tmp_path,
        4,
        "cluster=slurm",
        "cluster.gpus_per_task=0",
        "cluster.nodes_per_task=2",
        "model.tensor_parallel_size=2",
    )
    monkeypatch.setattr(socket, "gethostbyname", lambda node: "127.0.0.1")
    monkeypatch.setattr(ranks, "RANK_EXIT_GRACE_S", 0.1)
    step = ranks.RankStep(run, ["n1", "n2"], "n1")
    step.cmd = cmd
    return step


def test_a_rank_step_that_ends_by_itself_kills_the_engine_here(tmp_path: Path, monkeypatch) -> None:
    import subprocess

    engine = subprocess.Popen(["sleep", "600"])  # stands for this node's engine processes
    step = rank_step(tmp_path, monkeypatch, ["sh", "-c", "exit 3"])
    try:
        step.start()
        step._watcher.join(30)
        assert step.died == "the engine ranks on n2 exited (srun exit status 3)"
        assert engine.wait(30) == -9  # killed, so the engine fails on the head and the failure is counted
    finally:
        engine.kill()
        step.stop()


def test_stopping_the_rank_step_is_no_failure(tmp_path: Path, monkeypatch) -> None:
    import subprocess

    engine = subprocess.Popen(["sleep", "600"])
    step = rank_step(tmp_path, monkeypatch, ["sleep", "600"])
    try:
        step.start()
        step.stop()  # TERM to srun, which passes it to every rank
        assert step.proc is not None and step.proc.returncode == -15
        step._watcher.join(30)
        assert step.died is None and engine.poll() is None  # the engine here is left alone
    finally:
        engine.kill()
        engine.wait()


def test_two_tasks_on_one_head_take_different_ports_when_one_was_pushed_up(monkeypatch) -> None:
    # Job A finds its first port taken and moves to the next one: job B's first port. B, choosing
    # while A holds it, moves on. Each port is bound at once by its holder (as the engine's head binds it).
    a = 7300
    first_a, first_b = ranks.PORT_BASE + a % 1000, ranks.PORT_BASE + (a + 1) % 1000
    held = []
    try:
        held.append(socket.create_server(("127.0.0.1", first_a)))  # another job's port on the head
        ports = []
        for job in (a, a + 1):
            monkeypatch.setenv("SLURM_JOB_ID", str(job))
            group = ranks.meeting_point("localhost", 2)
            assert (group.master_addr, group.nnodes) == ("127.0.0.1", 2)
            held.append(socket.create_server((group.master_addr, group.master_port)))  # holds it
            ports.append(group.master_port)
        assert ports == [first_a + 1, first_b + 1] and first_b == first_a + 1
    finally:
        for s in held:
            s.close()
