"""The dev Slurm cluster (slurm/dev/up.sh) and runs on it: submit, wait, look at jobs and their processes."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Optional

from batchinfer.config.compose import hydra_literal
from batchinfer.launch.jobs import all_job_ids, submissions
from batchinfer.rundir.store import RunDir
from support import REPO
from support.corpus import write_corpus
from support.procs import run_cli
from support.runs import model_overrides


def use_dev_cluster(**env: str) -> dict[str, str]:
    """Bring the dev cluster up with these knobs (slurm/dev/up.sh: idempotent, ~0.1 s when it runs;
    it restarts the daemons when slurm.conf changes) and use it in this process and its children."""
    res = subprocess.run(
        ["bash", str(REPO / "slurm/dev/up.sh")],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, **env),
    )
    assert res.returncode == 0, f"slurm/dev/up.sh failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}"
    env_sh = res.stdout.strip().splitlines()[-1].removeprefix("source ").strip()
    for line in Path(env_sh).read_text().splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        os.environ[key] = os.path.expandvars(value)
    ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True)
    assert "UP" in ping.stdout, ping.stdout + ping.stderr
    return dict(os.environ)


# Each task waits after its first committed part until a stop signal (at most this long; not after a
# requeue): the signal, requeue or engine kill of a test surely lands on a partial shard, so the
# corpora stay small. Shards need more rows than vLLM runs at once (max_num_seqs, 256 on CPU) so
# that their first part is not the whole shard.
HOLD = "+cluster.env.BATCHINFER_HOLD=240"


def cluster_overrides(tmp: Path, corpus: Path, model: Path, *extra: str, out: Optional[Path] = None) -> list[str]:
    """A small CPU run into out (default tmp/run); paths quoted for Hydra's grammar, as a user types them."""
    return [
        "cluster=slurm",
        f"input.path={hydra_literal(str(corpus))}",
        "input.id_column=id",
        f"output.dir={hydra_literal(str(out or tmp / 'run'))}",
        "cluster.gpus_per_task=0",
        "cluster.cpus_per_task=2",
        "cluster.mem=null",
        "cluster.array_parallelism=1",
        "cluster.time=20",
        "+cluster.env.VLLM_CPU_KVCACHE_SPACE=1",
        *model_overrides(model),
        *extra,
    ]


def submit_corpus(
    tmp: Path, model: Path, n: int, seed: int, *extra: str, env: Optional[dict[str, str]] = None
) -> tuple[list[dict], Path, str]:
    """Write a corpus of n rows, `batchinfer submit` it (the jobs get submit's environment: env, for
    the stand-in engine, standin_env()); return its rows, DIR and submit's stdout."""
    corpus = tmp / "c.jsonl"
    rows = write_corpus(corpus, n, seed=seed)
    res = run_cli(["submit", *cluster_overrides(tmp, corpus, model, *extra)], env=env)
    assert res.returncode == 0, res.stderr
    return rows, tmp / "run", res.stdout


def jobs_of(run_dir: Path) -> list[str]:
    return all_job_ids(RunDir(run_dir))


def first_submission(run_dir: Path) -> dict[str, Any]:
    """The first submission of DIR, folded from its jobs.jsonl lines."""
    return submissions(RunDir(run_dir))[0]


def queued(run_dir: Path) -> list[str]:
    """Jobs (array tasks expanded) of DIR still in squeue."""
    res = subprocess.run(
        ["squeue", "-h", "-r", "-o", "%i %T", "-j", ",".join(jobs_of(run_dir))], capture_output=True, text=True
    )
    if res.returncode != 0:  # a busy controller (2 cores, engines starting) is not an idle queue
        return [f"squeue failed: {res.stderr.strip()}"]
    return [ln for ln in res.stdout.splitlines() if ln.strip()]


def wait_until_idle(run_dir: Path, timeout: float = 900) -> None:
    """Until no job of DIR is queued, seen twice 5 s apart (a requeue passes through states quickly)."""
    deadline = time.monotonic() + timeout
    idle = 0
    while idle < 2:
        idle = idle + 1 if not queued(run_dir) else 0
        assert time.monotonic() < deadline, f"jobs still queued: {queued(run_dir)}"
        time.sleep(5 if idle else 2)


def wait_for(cond: Any, timeout: float = 300, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def status_json(run_dir: Path) -> dict[str, Any]:
    res = run_cli(["status", str(run_dir), "--json"])
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def sacct_runs(job: str) -> list[str]:
    """The states of every run of job, requeued ones included (sacct -D)."""
    res = subprocess.run(["sacct", "-n", "-X", "-D", "-P", "-o", "State", "-j", job], capture_output=True, text=True)
    return res.stdout.split()


def task_running(job: str) -> bool:
    res = subprocess.run(["squeue", "-h", "-o", "%T", "-j", job], capture_output=True, text=True)
    return res.stdout.strip() == "RUNNING"


def under_slurmstepd(pid: int) -> bool:
    """Whether a process descends from a slurmstepd (a job's process, not this test's engine)."""
    while pid > 1:
        try:
            with open(f"/proc/{pid}/stat") as f:
                head, _, rest = f.read().rpartition(")")
        except OSError:
            return False
        if head.split("(", 1)[1] == "slurmstepd":
            return True
        pid = int(rest.split()[1])
    return False


def job_engine_pids() -> list[int]:
    res = subprocess.run(["pgrep", "-f", "EngineCore"], capture_output=True, text=True)
    return [int(p) for p in res.stdout.split() if under_slurmstepd(int(p))]


def job_worker_pid(job: str) -> Optional[int]:
    """The batchinfer worker of a running job or array task (A_T): the submitit process slurmstepd
    started for its step."""
    array, _, task = job.partition("_")
    marks = [f"SLURM_ARRAY_JOB_ID={array}", f"SLURM_ARRAY_TASK_ID={task}"] if task else [f"SLURM_JOB_ID={job}"]
    res = subprocess.run(["pgrep", "-f", "submitit.core._submit"], capture_output=True, text=True)
    for pid in map(int, res.stdout.split()):
        try:
            parent = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if Path(f"/proc/{parent}/comm").read_text().strip() == "slurmstepd" and all(
            m.encode() in environ for m in marks
        ):
            return pid
    return None


def signal_usr2_then_term(job: str) -> None:
    """USR2 then TERM to a running job, both pending when its worker next runs."""
    worker = job_worker_pid(job)
    assert worker, f"the worker process of {job}"
    # Hold the worker so both signals are pending when it resumes (a running worker could act on
    # USR2 before scancel delivers TERM); Python then runs their handlers in signal-number order,
    # USR2 (12) first. The engine is not held: TERM kills it, as at a real time limit.
    os.kill(worker, 19)  # SIGSTOP
    try:
        for sig in ("USR2", "TERM"):
            subprocess.run(["scancel", f"--signal={sig}", job], timeout=15, capture_output=True)
        time.sleep(2)
    finally:
        os.kill(worker, 18)  # SIGCONT
