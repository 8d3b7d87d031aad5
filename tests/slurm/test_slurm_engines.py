"""Two engines in one array task (cluster.engines_per_task=2, one core each) on the dev cluster:
shards handed out one at a time, USR2 requeues the task once with both engines' rows kept, and a
killed engine leaves its sibling's shards finished and its own resumed on requeue. The stand-in
engine throughout: the task's supervisor, its members and Slurm are what these prove."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from support.corpus import assert_exactly_once, project, read_output, write_corpus
from support.procs import run_cli
from support.runs import committed_rows
from support.slurm import (
    REPO,
    cluster_overrides,
    first_submission,
    sacct_runs,
    status_json,
    submit_corpus,
    wait_for,
    wait_until_idle,
)
from support.standin import StandinEngine, standin_env

from batchinfer.config.compose import compose
from batchinfer.launch.local import run_local

pytestmark = [pytest.mark.slurm]
# 4 shards of 100 rows in one task, 2 engines on its 2 cores; each engine holds after its first part
# (not after a requeue) so the test's signal or kill lands on partial shards of both engines.
EXTRA = [
    "sharding.num_shards=4",
    "cluster.shards_per_task=4",
    "cluster.engines_per_task=2",
    "sampling.max_tokens=16",
    "output.commit_every_rows=16",
]


def progress_by_engine(run_dir: Path) -> dict[int, dict[str, Any]]:
    """{engine index: progress.json} of unfinished shards with committed rows."""
    out = {}
    for p in run_dir.glob("shards/*/progress.json"):
        rec = json.loads(p.read_text())
        if rec.get("engine") and rec.get("rows_done", 0) > 0 and not (p.parent / "DONE.json").exists():
            out[rec["engine"]["index"]] = rec
    return out


def task_logs(run_dir: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in (run_dir / "logs").rglob("*_log.err"))


@pytest.mark.timeout(1800)  # its tasks run one after another (array parallelism 1)
def test_two_engines_usr2_requeues_once_and_keeps_both_engines_rows(tmp_path: Path, tiny_model_path: Path) -> None:
    """Through submitit, USR2 to every process of the task. The stand-in engine: the supervisor's
    one decision for the task is what this proves (that vLLM's engine-core processes outlive a
    group-wide USR2 is test_slurm.py's single-engine case; members block USR2 before they start)."""
    rows, run_dir, _ = submit_corpus(
        tmp_path, tiny_model_path, 400, 21, *EXTRA, "+cluster.env.BATCHINFER_HOLD=240", env=standin_env()
    )
    task = first_submission(run_dir)["arrays"][0]["job_id"]  # an array of one task: its job id
    wait_for(lambda: set(progress_by_engine(run_dir)) == {0, 1}, timeout=600, what="both engines' first parts")
    partial = progress_by_engine(run_dir)
    before = committed_rows(run_dir)
    # Preemption notice: once, under a short timeout (see DESIGN: scancel retries for ~95 s).
    sent = subprocess.run(["scancel", "--signal=USR2", task], timeout=15, capture_output=True, text=True)
    assert sent.returncode == 0, sent.stderr
    wait_until_idle(run_dir)
    out = read_output(run_dir)
    assert_exactly_once(out, rows)
    # Both engines' rows committed before the signal are in the output as they were committed.
    after = committed_rows(run_dir)  # from each shard's compacted file now
    assert before and {r: after[r] for r in before} == before
    for rec in partial.values():
        assert 0 < rec["rows_done"] < rec["rows_total"], rec
    logs = task_logs(run_dir)
    assert "received SIGUSR2: every engine commits and stops" in logs
    assert logs.count("] requeued ") == 1, logs[-3000:]  # the task requeues once, not per engine
    assert "resuming" in logs
    assert sacct_runs(task)[:1] == ["REQUEUED"] and sacct_runs(task)[-1] == "COMPLETED", sacct_runs(task)
    # Every shard finished once; the first run's engines each ran on a core of its own.
    done = [json.loads(p.read_text()) for p in sorted(run_dir.glob("shards/*/DONE.json"))]
    assert [d["rows_done"] for d in done] == [100] * 4
    cores = {rec["engine"]["devices"] for rec in partial.values()}
    assert cores == {"cpu:0", "cpu:1"}, cores
    ov = cluster_overrides(tmp_path, tmp_path / "c.jsonl", tiny_model_path, *EXTRA[:1], *EXTRA[3:])
    local = compose([*ov, f"output.dir={tmp_path}/clean", "cluster=local"])
    assert project(out) == project(read_output(run_local(local, engine=StandinEngine(local)).path))


@pytest.mark.timeout(1200)  # its tasks run one after another (array parallelism 1)
def test_one_engine_killed_leaves_its_sibling_working_and_resumes_on_requeue(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    # The stand-in engine: the task's handling of a member killed alone is what this proves (a fork
    # holding the pipe, as vLLM's engine core could, is tests/unit/engine/test_engines.py's case).
    hold = (
        "+cluster.env.BATCHINFER_HOLD=12"  # each engine waits after its first part: long enough to kill engine 1 there
    )
    rows, run_dir, _ = submit_corpus(tmp_path, tiny_model_path, 400, 22, *EXTRA, hold, env=standin_env())
    task = first_submission(run_dir)["arrays"][0]["job_id"]  # an array of one task: its job id
    wait_for(lambda: 1 in progress_by_engine(run_dir), timeout=600, what="engine 1's first part")
    victim = progress_by_engine(run_dir)[1]
    shard = victim["shard"]
    os.kill(victim["holder"]["pid"], signal.SIGKILL)  # engine 1's worker alone, not its group
    before = committed_rows(run_dir)
    wait_until_idle(run_dir)
    assert_exactly_once(read_output(run_dir), rows)
    logs = task_logs(run_dir)
    assert f"engine 1 of 2 (devices cpu:1) failed on shard {shard}" in logs, logs[-3000:]
    assert "killed by SIGKILL" in logs and logs.count("] requeued ") == 1
    done = {d["shard"]: d for d in (json.loads(p.read_text()) for p in run_dir.glob("shards/*/DONE.json"))}
    # The killed engine's shard was partial, its death counted under its lock, and it was resumed
    # on the requeue; the other shards were all finished by engine 0 in the first run.
    assert 0 < victim["rows_done"] < 100
    assert done[shard]["failures"] == 1 and done[shard]["attempts"] == 2, done[shard]
    assert done[shard]["engine"]["of"] == 1  # one shard left: one engine, holding the whole task
    others = [d for s, d in done.items() if s != shard]
    assert all(d["engine"]["index"] == 0 and d["attempts"] == 1 for d in others), others
    after = committed_rows(run_dir)
    assert before and {r: after[r] for r in before} == before
    assert sacct_runs(task)[-1] == "COMPLETED"


@pytest.mark.timeout(1200)
def test_plain_sbatch_two_engines_act_on_usr2_sent_to_the_batch_shell_alone(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    """slurm/batchinfer.sbatch signals the batch shell alone (`B:USR2`, here `scancel -b`): the
    task's supervisor, which blocked USR2 in cli.main, must take it and pass it on to its engines,
    which commit; the task requeues once and finishes."""
    corpus = tmp_path / "c.jsonl"
    rows = write_corpus(corpus, 400, seed=23)
    ov = cluster_overrides(tmp_path, corpus, tiny_model_path, *EXTRA)
    res = run_cli(["submit", "--dry-run", *ov])
    assert res.returncode == 0 and "task 0: shards [0, 1, 2, 3]" in res.stdout, res.stdout + res.stderr
    run_dir = tmp_path / "run"
    cmd = ["sbatch", "--parsable", "--array=0", "--gpus-per-task=0", "--cpus-per-task=2", f"--chdir={tmp_path}"]
    env = dict(standin_env(), BATCHINFER_HOLD="240")  # sbatch's --export=ALL hands them to the task
    job = subprocess.run(
        [*cmd, str(REPO / "slurm/batchinfer.sbatch"), str(run_dir)], capture_output=True, text=True, env=env
    )
    assert job.returncode == 0, job.stderr
    task = job.stdout.strip().split(";")[0] + "_0"
    wait_for(lambda: set(progress_by_engine(run_dir)) == {0, 1}, timeout=600, what="both engines' first parts")
    before = committed_rows(run_dir)
    sent = subprocess.run(["scancel", "-b", "--signal=USR2", task], timeout=15, capture_output=True, text=True)
    assert sent.returncode == 0, sent.stderr
    wait_for(
        lambda: not subprocess.run(["squeue", "-h", "-j", task], capture_output=True, text=True).stdout.strip(),
        timeout=900,
        what="the task to finish",
    )
    logs = "".join(p.read_text(errors="replace") for p in tmp_path.glob("batchinfer-*.err"))
    assert "received SIGUSR2: every engine commits and stops" in logs, logs[-3000:]
    assert logs.count("] requeued ") == 1 and "resuming" in logs, logs[-3000:]
    assert sacct_runs(task)[:1] == ["REQUEUED"] and sacct_runs(task)[-1] == "COMPLETED", sacct_runs(task)
    assert status_json(run_dir)["totals"]["states"] == {"done": 4}
    res = run_cli(["merge", str(run_dir)])
    assert res.returncode == 0, res.stderr
    assert_exactly_once(read_output(run_dir), rows)
    after = committed_rows(run_dir)
    assert before and {r: after[r] for r in before} == before  # both engines' rows kept as committed
