"""A real single-node Slurm cluster (slurm/dev/up.sh): submit, status, preemption, requeue, failure, resume, cancel.

Preemption (USR2, then TERM) and an engine's death run vLLM in the tasks; the rest, an external
requeue among them, run the stand-in engine (tests/support/standin.py): Slurm's side is what they
prove."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from support.corpus import assert_exactly_once, project, read_output, write_corpus
from support.procs import run_cli
from support.runs import assert_engine_output_kept_apart, committed_rows
from support.slurm import (
    HOLD,
    REPO,
    cluster_overrides,
    first_submission,
    job_engine_pids,
    queued,
    sacct_runs,
    signal_usr2_then_term,
    status_json,
    submit_corpus,
    task_running,
    wait_for,
    wait_until_idle,
)
from support.standin import standin_env

from batchinfer.config.compose import compose
from batchinfer.launch.local import run_local

pytestmark = [pytest.mark.slurm, pytest.mark.engine]


@pytest.mark.timeout(1200)
def test_usr2_then_term_requeues_once_and_the_next_run_resumes(
    slurm_env: dict, tmp_path: Path, tiny_model_path: Path, engine: Any
) -> None:
    """The real engine in the task: Slurm's preemption notice (USR2), then the time limit's TERM
    before the worker has acted on the first; the first signal's intent (requeue) must win, the
    engine's processes must not die of USR2, and no vLLM line reaches the task's logs."""
    extra = ["sharding.num_shards=1", "sampling.max_tokens=16", "output.commit_every_rows=16"]
    # a shard of 200 rows: the hold after its first part is what makes the signal land on a
    # partial shard, not the shard's size
    rows, run_dir, _ = submit_corpus(tmp_path, tiny_model_path, 200, 12, *extra, HOLD)
    ov = cluster_overrides(tmp_path, tmp_path / "c.jsonl", tiny_model_path, *extra)
    job = first_submission(run_dir)["arrays"][0]["job_id"]  # an array of one task: its job id
    wait_for(lambda: list(run_dir.glob("shards/00000/part-*")), what="a committed part of shard 0")
    before = committed_rows(run_dir)
    signal_usr2_then_term(job)
    wait_until_idle(run_dir)
    out = read_output(run_dir)
    assert_exactly_once(out, rows)
    after = committed_rows(run_dir)
    assert 0 < len(before) < len(rows) and {r: after[r] for r in before} == before
    clean = read_output(run_local(compose([*ov, f"output.dir={tmp_path}/clean", "cluster=local"]), engine=engine).path)
    assert project(out) == project(clean)
    logs = "".join(p.read_text(errors="replace") for p in (run_dir / "logs").rglob("*_log.err"))
    assert "received SIGUSR2: committing and stopping" in logs and "received SIGTERM after SIGUSR2" in logs
    assert logs.count(f"requeued {job}") == 1 and "resuming" in logs, logs[-3000:]
    # vLLM's lines must reach neither of a task's logs: stdout (`*_log.out`) as well as stderr
    task_output = "".join(p.read_text(errors="replace") for p in (run_dir / "logs").rglob("*_log.*"))
    assert_engine_output_kept_apart(run_dir, task_output)
    done = json.loads((run_dir / "shards/00000/DONE.json").read_text())
    assert done["attempts"] == 2, done
    # sacct -D keeps the requeued run: REQUEUED, then the run that finished
    assert sacct_runs(job) == ["REQUEUED", "COMPLETED"], sacct_runs(job)


@pytest.mark.timeout(900)
def test_an_external_requeue_commits_and_the_next_run_resumes(
    slurm_env: dict, tmp_path: Path, tiny_model_path: Path
) -> None:
    """`scontrol requeue` of a running task (an admin, a node drained with requeue): Slurm ends it
    (TERM: commit, no requeue of its own) and runs it again, which resumes. The stand-in engine:
    Slurm's side is what this proves."""
    extra = ["sharding.num_shards=1", "sampling.max_tokens=16", "output.commit_every_rows=16"]
    rows, run_dir, _ = submit_corpus(tmp_path, tiny_model_path, 200, 16, *extra, HOLD, env=standin_env())
    job = first_submission(run_dir)["arrays"][0]["job_id"]  # an array of one task: its job id
    wait_for(lambda: list(run_dir.glob("shards/00000/part-*")) and task_running(job), what="a committed part")
    before = committed_rows(run_dir)
    subprocess.run(["scontrol", "requeue", job], check=True, timeout=30)
    wait_until_idle(run_dir)
    assert_exactly_once(read_output(run_dir), rows)
    after = committed_rows(run_dir)
    assert 0 < len(before) < len(rows) and {r: after[r] for r in before} == before
    logs = "".join(p.read_text(errors="replace") for p in (run_dir / "logs").rglob("*_log.err"))
    assert "received SIGTERM: committing and stopping" in logs and "resuming" in logs, logs[-3000:]
    assert f"requeued {job}" not in logs, logs[-3000:]  # Slurm requeued it, not the worker
    done = json.loads((run_dir / "shards/00000/DONE.json").read_text())
    assert done["attempts"] == 2, done
    assert sacct_runs(job) == ["REQUEUED", "COMPLETED"], sacct_runs(job)


@pytest.mark.timeout(900)  # its tasks run one after another (array parallelism 1)
def test_failed_task_named_by_status_merge_refuses_then_resume(
    slurm_env: dict, tmp_path: Path, tiny_model_path: Path
) -> None:
    extra = ["sharding.num_shards=1", "sampling.max_tokens=16", "output.commit_every_rows=16"]
    fault = "+cluster.env.BATCHINFER_FAULT=after-part-rename:2"
    rows, run_dir, _ = submit_corpus(tmp_path, tiny_model_path, 150, 13, *extra, fault, env=standin_env())
    wait_until_idle(run_dir)
    st = status_json(run_dir)
    assert st["totals"]["states"] == {"failed": 1}, st
    for shard in st["shards"]:
        assert shard["state"] == "failed" and shard["job_state"] == "FAILED" and shard["error"]
        assert 0 < shard["rows_done"] < shard["rows"]
    text = run_cli(["status", str(run_dir)]).stdout
    assert "failed" in text and "of 150" in text
    merge_job = first_submission(run_dir)["merge"]
    merge_err = next((run_dir / "logs").rglob(f"{merge_job}_0_log.err")).read_text()
    assert "1 of 1 shards are incomplete (shards 0)" in merge_err
    assert not (run_dir / "output.parquet").exists()
    res = run_cli(["resume", str(run_dir), "cluster.env.BATCHINFER_FAULT="], env=standin_env())
    assert res.returncode == 0, res.stderr
    assert "submitted 1 shard of" in res.stdout
    wait_until_idle(run_dir)
    assert_exactly_once(read_output(run_dir), rows)
    assert status_json(run_dir)["totals"]["states"] == {"done": 1}


@pytest.mark.timeout(1200)  # its tasks run one after another (array parallelism 1)
def test_engine_death_commits_and_requeues_until_max_attempts(
    slurm_env: dict, tmp_path: Path, tiny_model_path: Path
) -> None:
    extra = ["sampling.max_tokens=16", "output.commit_every_rows=16", "cluster.max_attempts=2"]
    # held 10 s after the first part: the engine is killed meanwhile, the next step finds it dead
    rows, run_dir, _ = submit_corpus(tmp_path, tiny_model_path, 240, 15, *extra, "+cluster.env.BATCHINFER_HOLD=10")
    wait_for(lambda: list(run_dir.glob("shards/00000/part-*")) and job_engine_pids(), what="a committed part")
    for pid in job_engine_pids():
        os.kill(pid, 9)  # the engine dies (OOM killer, GPU fault) while the worker lives
    wait_until_idle(run_dir)
    assert_exactly_once(read_output(run_dir), rows)
    done = json.loads((run_dir / "shards/00000/DONE.json").read_text())
    assert done["failures"] == 1 and done["attempts"] == 2, done
    logs = "".join(p.read_text(errors="replace") for p in (run_dir / "logs").rglob("*_log.err"))
    assert "attempt 1 of 2: requeueing" in logs


@pytest.mark.timeout(1200)  # its tasks run one after another (array parallelism 1)
def test_running_array_status_then_resume_refused_then_cancel_commits_and_does_not_requeue(
    slurm_env: dict, tmp_path: Path, tiny_model_path: Path
) -> None:
    extra = ["sharding.num_shards=2", "sampling.max_tokens=16", "output.commit_every_rows=16"]
    # 50 ms a stand-in step: rates of tens of rows/s, so the ETA of the 1,200 rows is whole seconds
    env = dict(standin_env(), BATCHINFER_STANDIN_STEP_SECONDS="0.05")
    _, run_dir, _ = submit_corpus(tmp_path, tiny_model_path, 1200, 14, *extra, HOLD, env=env)
    res = run_cli(["resume", str(run_dir)])
    assert res.returncode == 2 and "still has jobs queued or running" in res.stderr

    def running_with_rows() -> bool:
        return any(s["state"] == "running" and s["rows_done"] > 0 for s in status_json(run_dir)["shards"])

    try:
        wait_for(running_with_rows, timeout=600, what="a running shard with committed rows")
        st = status_json(run_dir)
        text = run_cli(["status", str(run_dir)]).stdout
    finally:
        res = run_cli(["cancel", str(run_dir)])
        wait_for(lambda: not queued(run_dir), timeout=120, what="cancelled jobs to leave squeue")
    assert res.returncode == 0 and "cancelled 2 jobs" in res.stdout, res.stdout + res.stderr
    # status of the running array: a shard's tok/s, the total and the ETA
    shard = next(s for s in st["shards"] if s["state"] == "running" and s["rows_done"] > 0)
    totals = st["totals"]
    assert shard["output_tokens_per_s"] > 0 and shard["rows_per_s"] > 0
    assert totals["running_tasks"] == 1 and totals["running_output_tokens_per_s"] == round(
        shard["output_tokens_per_s"], 1
    )
    assert totals["eta_seconds"] > 0 and totals["eta_seconds"] == round(
        (1200 - totals["rows_done"]) / shard["rows_per_s"]
    )
    # The text (a moment later: figures may have moved on) shows a shard's tok/s, the total and the ETA.
    line = re.search(rf"^\s*{shard['shard']}\s+running\s+\d+ of 600\s+([\d.]+)\s", text, re.M)
    now = re.search(r"now ([\d.]+) tok/s over 1 running task; ETA (\d+) h (\d+) min (\d+) s", text)
    assert line and now, text
    assert float(line.group(1)) > 0 and float(now.group(1)) > 0 and sum(map(int, now.groups()[1:])) > 0
    # The worker on the compute node is this checkout's (it records the time series).
    progress = json.loads((run_dir / f"shards/{shard['shard']:05d}/progress.json").read_text())
    assert progress["series"] and progress["series"][-1]["rows_done"] == progress["rows_done"]
    # The cancel: the running task committed and stopped, and did not requeue itself.
    time.sleep(15)  # a task that requeued itself would be back in squeue by now
    assert not queued(run_dir)
    logs = "".join(p.read_text(errors="replace") for p in (run_dir / "logs").rglob("*_log.err"))
    assert "received SIGTERM: committing and stopping" in logs and "requeued" not in logs
    after = status_json(run_dir)["shards"][shard["shard"]]
    assert 0 < after["rows_done"] < after["rows"] and after["state"] == "failed", after


def test_resume_refuses_keys_that_change_outputs(slurm_env: dict, tmp_path: Path, tiny_model_path: Path) -> None:
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 4)
    res = run_cli(["submit", "--dry-run", *cluster_overrides(tmp_path, corpus, tiny_model_path)])
    assert res.returncode == 0 and "task 0: shards [0]" in res.stdout
    res = run_cli(["resume", str(tmp_path / "run"), "sampling.max_tokens=3", "--dry-run"])
    assert res.returncode == 2 and "refused: sampling.max_tokens" in res.stderr
    res = run_cli(["resume", str(tmp_path / "run"), "cluster.time=99", "--dry-run"])
    assert res.returncode == 0 and "'time': 99" in res.stdout


LOGIN_NODE = """
import sys
from batchinfer.cli import main
codes = [main(args.split("\\x1f")) for args in sys.argv[1:]]
heavy = sorted(m for m in ("vllm", "torch", "transformers") if m in sys.modules)
print("CODES", codes, "HEAVY", heavy)
"""


def test_login_node_commands_import_no_vllm_or_torch(slurm_env: dict, tmp_path: Path, tiny_model_path: Path) -> None:
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 6)
    sep = "\x1f"
    run_dir = str(tmp_path / "run")
    commands = [
        sep.join(["submit", "--dry-run", *cluster_overrides(tmp_path, corpus, tiny_model_path)]),
        sep.join(["status", run_dir]),
        sep.join(["resume", run_dir, "--dry-run"]),
        sep.join(["cancel", run_dir]),
    ]
    res = subprocess.run([sys.executable, "-c", LOGIN_NODE, *commands], capture_output=True, text=True)
    assert "CODES [0, 0, 0, 0] HEAVY []" in res.stdout, res.stdout + res.stderr


def test_plain_sbatch_script_runs_the_worker(slurm_env: dict, tmp_path: Path, tiny_model_path: Path) -> None:
    corpus = tmp_path / "c.jsonl"
    rows = write_corpus(corpus, 40, seed=16)
    ov = cluster_overrides(
        tmp_path, corpus, tiny_model_path, "sharding.num_shards=2", "cluster.shards_per_task=2", "sampling.max_tokens=4"
    )
    res = run_cli(["submit", "--dry-run", *ov])
    assert res.returncode == 0 and "task 0: shards [0, 1]" in res.stdout
    run_dir = tmp_path / "run"
    cmd = ["sbatch", "--parsable", "--array=0", "--gpus-per-task=0", "--cpus-per-task=2", f"--chdir={tmp_path}"]
    job = subprocess.run(
        [*cmd, str(REPO / "slurm/batchinfer.sbatch"), str(run_dir)], capture_output=True, text=True, env=standin_env()
    )
    assert job.returncode == 0, job.stderr
    job_id = job.stdout.strip().split(";")[0]
    wait_for(
        lambda: not subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True).stdout.strip(),
        timeout=600,
        what="the sbatch array",
    )
    assert status_json(run_dir)["totals"]["states"] == {"done": 2}
    res = run_cli(["merge", str(run_dir)])
    assert res.returncode == 0, res.stderr
    assert_exactly_once(read_output(run_dir), rows)


def test_second_array_refused_by_sbatch_is_cancelled(slurm_env: dict, tmp_path: Path, tiny_model_path: Path) -> None:
    # MaxArraySize 2 (scontrol wrapper) splits 3 tasks into two arrays; sbatch refuses the second.
    wrappers = tmp_path / "bin"
    wrappers.mkdir()
    real = {
        name: subprocess.run(["which", name], capture_output=True, text=True).stdout.strip()
        for name in ("sbatch", "scontrol")
    }
    refusal = "sbatch: error: Batch job submission failed: Job violates accounting/QOS policy (job submit limit)"
    (wrappers / "sbatch").write_text(
        '#!/bin/sh\nn=$(cat "$0.count" 2>/dev/null || echo 0); echo $((n + 1)) > "$0.count"\n'
        f'[ "$n" = 0 ] || {{ echo "{refusal}" >&2; exit 1; }}\nexec {real["sbatch"]} "$@"\n'
    )
    (wrappers / "scontrol").write_text(
        f'#!/bin/sh\nif [ "$1 $2" = "show config" ]; then {real["scontrol"]} "$@" | sed "s/^MaxArraySize .*/MaxArraySize = 2/"\n'
        f'else exec {real["scontrol"]} "$@"; fi\n'
    )
    for w in wrappers.iterdir():
        w.chmod(0o755)
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 30, seed=19)
    ov = cluster_overrides(tmp_path, corpus, tiny_model_path, "sharding.num_shards=3", "sampling.max_tokens=4")
    res = run_cli(["submit", *ov], env=standin_env(dict(os.environ, PATH=f"{wrappers}:{os.environ['PATH']}")))
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "sbatch refused array 1 of 2 of submission 0: " + refusal in res.stderr and "cluster.qos" in res.stderr
    run_dir = tmp_path / "run"
    sub = first_submission(run_dir)
    assert len(sub["arrays"]) == 1 and not sub["complete"]
    array = sub["arrays"][0]["job_id"]
    assert f"Already queued: array {array} (shards [0, 1])" in res.stderr
    assert queued(run_dir), "the first array is in the queue"
    res = run_cli(["cancel", str(run_dir)])
    assert res.returncode == 0 and f"cancelled 1 jobs of {run_dir}: {array}" in res.stdout
    wait_for(lambda: not queued(run_dir), timeout=120, what="the cancelled array to leave squeue")
    res = run_cli(["resume", str(run_dir), "--dry-run"])  # the directory takes a new submission
    # shard 2 (never submitted) is planned; shards 0 and 1 too unless a task finished before the cancel
    assert res.returncode == 0 and re.search(r"task \d+: shards \[(\d+, )*2\]", res.stdout), res.stdout + res.stderr
