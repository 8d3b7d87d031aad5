"""`batchinfer tune ... cluster=slurm` on the dev cluster: the whole tune runs as one Slurm job (its
trial engine a process of that job), the login side waits and prints the same result a local tune
writes; `status TUNE` follows the job and `cancel TUNE` stops another one. The stand-in engine: the
Slurm path is what this proves (tests/cli/test_tune.py runs a tune on the real engine)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from support.corpus import write_corpus
from support.procs import run_cli
from support.slurm import cluster_overrides, job_worker_pid, wait_for
from support.standin import standin_env

pytestmark = [pytest.mark.slurm]

# The keys a local tune's --json has (tests/cli/test_tune.py proves their content there).
RESULT_KEYS = {
    "version",
    "created",
    "fingerprint",
    "overrides",
    "config_dir",
    "folder",
    "sample",
    "settings",
    "best",
    "output_lengths",
    "layout",
    "price",
    "forecast",
    "choice",  # why the winner was chosen (the noise rule)
    "forecast_model",  # the fitted cost of an engine step
}


def sacct_state(job: str) -> str:
    res = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "State", "-j", job], capture_output=True, text=True)
    return (res.stdout.split() or [""])[0]


@pytest.mark.timeout(900)
def test_tune_runs_as_one_slurm_job_status_and_cancel_follow_it(
    slurm_env: dict, tmp_path: Path, tiny_model_path: Path
) -> None:
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 40, seed=29)
    ov = cluster_overrides(tmp_path, corpus, tiny_model_path, "sampling.max_tokens=6")
    out = tmp_path / "T"
    env = standin_env()
    res = run_cli(["tune", *ov, "--rows", "8", "--try", "defaults", "--out", str(out), "--json"], env=env, timeout=800)
    assert res.returncode == 0, res.stderr[-3000:]
    job = json.loads((out / "job.json").read_text())["job_id"]
    assert f"submitted the tune as Slurm job {job}" in res.stderr and f"results: {out}/tune.md" in res.stderr
    assert "[batchinfer " in res.stderr and "tune: drawing a 8-row pilot" in res.stderr  # the job's lines, relayed
    result = json.loads(res.stdout)
    assert set(result) == RESULT_KEYS and result == json.loads((out / "tune.json").read_text())
    (setting,) = result["settings"]
    assert setting["name"] == "defaults" and setting["failure"] is None and setting["rows"] == 8
    assert setting["output_tokens_per_s"] > 0 and setting["startup_seconds"] > 0
    assert result["best"]["name"] == "defaults" and result["sample"]["rows"] == 40
    # the pilot's mean output length x the corpus's 40 rows
    assert result["forecast"]["output_tokens"]["value"] == pytest.approx(result["output_lengths"]["mean"] * 40)
    assert (out / "tune.png").is_file() and (out / "conf" / "tuned" / "best.yaml").is_file()
    # the trial committed its rung without the tune job's identity: a failed rung or a stop signal
    # cannot make it `scontrol requeue` the tune job (the tune job is never requeued)
    (progress_path,) = (out / "trials").glob("*/00/runs/rung-0/shards/00000/progress.json")  # this tune's trials
    progress = json.loads(progress_path.read_text())
    assert progress["holder"]["slurm_job"] is None and progress["rows_done"] == 8, progress["holder"]
    assert sacct_state(job) == "COMPLETED"
    st = json.loads(run_cli(["status", str(out), "--json"]).stdout)
    assert (st["kind"], st["job_id"], st["state"], st["done"]) == ("tune", job, "COMPLETED", True)
    assert st["result"] == result

    # another tune, not waited for: its job is cancelled while it draws the pilot or starts the engine
    other = tmp_path / "T2"
    res = run_cli(["tune", *ov, "--rows", "8", "--try", "defaults", "--out", str(other), "--no-wait"], env=env)
    assert res.returncode == 0, res.stderr
    second = json.loads((other / "job.json").read_text())["job_id"]
    assert res.stdout.splitlines()[0].startswith(f"submitted the tune as Slurm job {second} ")
    text = run_cli(["status", str(other)]).stdout
    assert text.splitlines()[0].split(" tune job ")[1].split()[0] == second
    res = run_cli(["cancel", str(other)])
    assert res.returncode == 0 and f"cancelled the tune job of {other}: {second}" in res.stdout
    wait_for(lambda: sacct_state(second) == "CANCELLED", timeout=120, what="the cancelled tune job")
    wait_for(lambda: job_worker_pid(second) is None, timeout=60, what="no process of the cancelled job left")
    assert run_cli(["status", str(other)]).stdout.splitlines()[0] == f"{other}: tune job {second} CANCELLED"
    assert not (other / "tune.json").exists()
