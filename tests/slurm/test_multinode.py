"""One engine over two nodes (cluster.nodes_per_task=2) on the two-node dev cluster
(SLURM_DEV_NODES=2 slurm/dev/up.sh): the first node runs the worker, the second vLLM's headless
ranks (TP 2 across the nodes, one core each).

The real engine runs once per proof that needs it (each start ~45 s here): a run of several
shards exactly once, equal to a one-process run of the same rows, through a USR2 that requeues
the allocation once, with committed rows unchanged. The head's death runs the stand-in engine on
the head (the rank on node2 is vLLM's headless executor all the same): what it proves is that no
process of the task is left on either node."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path
from typing import Any

import pytest
from support.corpus import assert_exactly_once, project, read_output, write_corpus
from support.procs import run_cli
from support.runs import committed_rows, model_overrides
from support.slurm import HOLD, first_submission
from support.standin import standin_env
from support.two_nodes import NODES, TwoNodeCluster, wait_until

from batchinfer.config.compose import compose, hydra_literal
from batchinfer.launch.local import run_local

pytestmark = [pytest.mark.slurm, pytest.mark.two_nodes]

SHARDS = ["sharding.num_shards=3", "sampling.max_tokens=6"]
# The first run of a task waits this long after its first committed part (none after a requeue):
# a rank killed meanwhile surely dies mid-run. A stop signal ends the wait.
RANK_HOLD = "+cluster.env.BATCHINFER_HOLD=60"


def two_node_overrides(tmp: Path, corpus: Path, model: Path, *extra: str) -> list[str]:
    """A CPU run of corpus into tmp/run: one task of every shard over both nodes (one core each)."""
    return [
        "cluster=slurm",
        f"input.path={hydra_literal(str(corpus))}",
        "input.id_column=id",
        f"output.dir={hydra_literal(str(tmp / 'run'))}",
        "cluster.gpus_per_task=0",
        "cluster.cpus_per_task=1",
        "cluster.mem=null",
        "cluster.time=20",
        "cluster.shards_per_task=3",
        "cluster.nodes_per_task=2",
        "+cluster.env.VLLM_CPU_KVCACHE_SPACE=1",
        *model_overrides(model),
        "model.tensor_parallel_size=2",
        *SHARDS,
        *extra,
    ]


def submit(cluster: TwoNodeCluster, tmp: Path, overrides: list[str], env: dict[str, str]) -> tuple[Path, str]:
    """`batchinfer submit` to the two-node cluster; DIR (tmp/run) and the task's job id."""
    res = run_cli(["submit", *overrides], env=env)
    assert res.returncode == 0, res.stderr
    run_dir = tmp / "run"
    return run_dir, first_submission(run_dir)["arrays"][0]["job_id"]


def task_logs(run_dir: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted((run_dir / "logs").rglob("*")) if p.is_file())


@pytest.mark.timeout(1200)
def test_an_engine_over_two_nodes_runs_each_row_once_through_a_dead_rank_and_usr2(
    cluster: TwoNodeCluster, tmp_path: Path, tiny_model_path: Path, engine: Any
) -> None:
    """Three runs of one task, one engine start each: node2's rank killed (the engine fails on the
    head: failure counted, requeued), USR2 during the next run's engine start (requeued once more),
    then the end. Several proofs in one test: each real engine start costs ~45 s here."""
    corpus = tmp_path / "c.jsonl"
    rows = write_corpus(corpus, 60, seed=30)
    # the first run waits up to 60 s after its first committed part (the later runs do not)
    ov = two_node_overrides(tmp_path, corpus, tiny_model_path, "output.commit_every_rows=8", RANK_HOLD)
    run_dir, job = submit(cluster, tmp_path, ov, cluster.env)
    wait_until(lambda: list(run_dir.glob("shards/*/part-*")), 600, "a committed part")
    # While the task holds: its processes run on both nodes (the engine's rank 1 on node2).
    running = cluster.job_processes(job)
    assert set(running) == set(NODES), running
    before = committed_rows(run_dir)
    assert 0 < len(before) < len(rows)
    # node2 fails: every process of the task there dies (the rank's main process and vLLM's
    # worker it started: killing the main process alone leaves the worker computing)
    assert any(_is_rank(p.split()[0], job) for p in running["node2"]), running
    on_node2 = [int(p.split()[0]) for p in running["node2"] if not p.endswith(" slurmstepd")]
    for pid in on_node2:
        os.kill(pid, signal.SIGKILL)
    log = run_dir / "logs" / "submission-000" / f"{job}_0_log.err"
    wait_until(lambda: log.read_text().count("starting vLLM engine") == 2, 600, "the second run's engine start")
    res = cluster.run("scancel", "--signal=USR2", job, timeout=30)
    assert res.returncode == 0, res.stderr
    merge = first_submission(run_dir)["merge"]
    cluster.wait_done(job, timeout=600)
    cluster.wait_done(merge, timeout=300)
    out = read_output(run_dir)
    assert_exactly_once(out, rows)
    # the same rows in one process, one engine of TP 1 (the session's): greedy, the same text
    local = [o for o in ov if not o.startswith(("cluster", "+cluster", "output.dir", "model.tensor"))]
    clean = run_local(compose([*local, "cluster=local", f"output.dir={tmp_path / 'clean'}"]), engine=engine)
    assert project(out) == project(read_output(clean.path))
    after = committed_rows(run_dir)
    assert {r: after[r] for r in before} == before  # committed before the faults: unchanged
    logs = task_logs(run_dir)
    # the dead rank failed the engine on the head, which counted it and requeued the task: the
    # head's engine core lost its link to node2's rank, or the head saw the ranks' step end first
    first_run = logs.split("starting vLLM engine")[1]  # to the second run's start
    failed = re.search(r"shard \d+ failed \((.*?)\), attempt 1 of 3: requeueing", first_run, re.S)
    assert failed and "EngineCore" in failed[1], first_run[-3000:]
    assert "Connection reset by peer" in first_run or "the engine ranks on node2 exited" in first_run
    # node2's fault, not the rows': none of the rows in flight was charged as a suspect
    assert "a node's fault; the" in first_run and "rows in flight are not suspects" in first_run
    # then USR2: committed, requeued once more (two requeues in all, by the head each time)
    assert "received SIGUSR2: committing and stopping" in logs
    assert len(re.findall(rf"requeued {job}(_0)?\b", logs)) == 2, logs[-3000:]
    # every run spanned both nodes; the last stopped node2's ranks itself
    assert logs.count("engine ranks of node 1 of 2, meeting the head at") == 3
    assert "the engine ranks on node2 have stopped" in logs
    assert "world_size=2 rank=1" in logs  # the engine's second rank (on node2) joined
    states = cluster.run("sacct", "-n", "-X", "-D", "-P", "-o", "State", "-j", job).stdout.split()
    assert states.count("REQUEUED") == 2 and states[-1] == "COMPLETED", states
    # no process of the task is left on either node
    wait_until(lambda: not cluster.job_processes(job), 60, f"no process of job {job} left")


@pytest.mark.timeout(600)
def test_the_head_killed_leaves_no_process_on_either_node(
    cluster: TwoNodeCluster, tmp_path: Path, tiny_model_path: Path
) -> None:
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 30, seed=31)
    ov = two_node_overrides(tmp_path, corpus, tiny_model_path, "output.commit_every_rows=4", HOLD)
    run_dir, job = submit(cluster, tmp_path, ov, standin_env(cluster.env))
    try:
        wait_until(lambda: list(run_dir.glob("shards/*/part-*")), 300, "a committed part")

        def rank_on_node2() -> bool:
            return any("python" in p for p in cluster.job_processes(job).get("node2", []))

        wait_until(rank_on_node2, 120, "the engine rank's process on node2")
        head = [
            int(pid)
            for pid in os.listdir("/proc")
            if pid.isdigit()
            and b"submitit.core._submit" in _cmdline(pid)
            and not _cmdline(pid).split(b"\0")[0].endswith(b"srun")  # the batch script's srun
            and _job_of(pid) == job
        ]
        assert len(head) == 1, head
        os.kill(head[0], signal.SIGKILL)
        # the head's step ends, its job with it, and Slurm ends the rank step on node2
        wait_until(lambda: not cluster.job_processes(job), 60, f"no process of job {job} left on either node")
        assert cluster.job_processes(job) == {}
    finally:
        run_cli(["cancel", str(run_dir)], env=cluster.env)


def _cmdline(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _job_of(pid: str) -> str:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return ""
    found = [e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"SLURM_JOB_ID=")]
    return found[0] if found else ""


def _is_rank(pid: str, job: str) -> bool:
    """Whether pid is the engine rank's main process (engine/headless.py) of job."""
    cmd = _cmdline(pid)
    return b"batchinfer.engine.headless" in cmd and not cmd.split(b"\0")[0].endswith(b"srun") and _job_of(pid) == job
