"""Slurm commands that hang, fail or refuse, faked by scripts on PATH (no cluster, no engine):
status without an answer from Slurm, a failed `scontrol requeue`, sbatch refusing a submission
(at once or at its second array), a timed-out sbatch, and the first stop signal winning."""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from support.fake_engine import FakeEngine
from support.fake_slurm import SUBMITTED, cli, overrides
from support.log_handlers import restored_log_handlers

from batchinfer.config.compose import compose
from batchinfer.engine.stopflag import StopFlag
from batchinfer.engine.vllm_engine import Completion
from batchinfer.errors import RequeueFailed
from batchinfer.launch import executor, slurm, slurm_task
from batchinfer.launch.jobs import submissions
from batchinfer.launch.local import run_shards
from batchinfer.launch.requeue import requeue_for_another_attempt
from batchinfer.rundir.prepare import prepare
from batchinfer.rundir.store import RunDir


@pytest.fixture(autouse=True)
def own_log_handlers() -> Any:
    """setup_logging (run by main and slurm_task) binds a handler to this test's captured stderr."""
    yield from restored_log_handlers(propagate=True)


class SteppingEngine(FakeEngine):
    """The fake engine, keyed to the run, calling on_step first at every step."""

    def __init__(self, run: RunDir, on_step: Any = None):
        from batchinfer.engine.engine_args import model_key

        super().__init__(per_step=3)
        self.key = model_key(run.config)
        self.on_step = on_step or (lambda: None)

    def step(self) -> list[Completion]:
        self.on_step()
        return super().step()


def test_first_stop_signal_wins(caplog: pytest.LogCaptureFixture) -> None:
    stop = StopFlag()
    with caplog.at_level(logging.WARNING, logger="batchinfer"):
        stop._handle(signal.SIGUSR2, None)
        stop._handle(signal.SIGTERM, None)  # the time limit, after the preemption notice
        stop.announce()  # the handler only records: the worker logs when it acts on the stop
    assert stop.signum == signal.SIGUSR2
    assert "received SIGTERM after SIGUSR2" in caplog.text
    stop = StopFlag()
    stop._handle(signal.SIGTERM, None)
    stop._handle(signal.SIGUSR2, None)
    assert stop.signum == signal.SIGTERM


def test_status_when_squeue_hangs_shows_the_run_directory(
    tmp_path: Path, fake_bin: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    run = prepare(compose(overrides(tmp_path, 12, "sharding.num_shards=2")))
    run_shards(run, [0], engine=SteppingEngine(run))
    # a jobs.jsonl line as earlier versions wrote it: one line per submission
    old = {"submission": 0, "time": 1.0, "folder": str(run.logs_dir / "submission-000"), "merge": "9"}
    old["arrays"] = [{"job_id": "8", "tasks": {"0": [0], "1": [1]}}]
    (run.path / "jobs.jsonl").write_text(json.dumps(old) + "\n")
    fake_bin("squeue", "exec sleep 1000")
    fake_bin("sacct", 'echo "sacct: error: Slurm accounting storage is disabled" >&2; exit 1')
    monkeypatch.setattr(slurm, "TIMEOUT_S", 0.5)
    code, out, err = cli(["status", str(run.path)], capsys)
    assert code == 0 and "Traceback" not in err
    assert "Slurm did not answer (sacct: exit 1: sacct: error: Slurm accounting storage is disabled; " in out
    assert "squeue: timed out after 0.5 s); states come from the run directory only" in out
    assert " 0  done " in out and "6 of 6" in out and " 1  pending " in out and "8_1" in out
    code, out, _ = cli(["status", str(run.path), "--json"], capsys)
    st = json.loads(out)
    assert [s["state"] for s in st["shards"]] == ["done", "pending"] and "squeue: timed out" in st["slurm"]["note"]


def test_failed_scontrol_requeue_fails_the_task(
    tmp_path: Path, fake_bin: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    run = prepare(compose(overrides(tmp_path, 30, "output.commit_every_rows=3")))
    fake_bin("scontrol", 'echo "scontrol: error: Requested operation is presently disabled for job 77_0" >&2; exit 1')
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "77")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "0")
    monkeypatch.setenv("SLURM_JOB_ID", "78")
    assert requeue_for_another_attempt() is False

    def preempted_engine() -> SteppingEngine:
        steps = []

        def on_step() -> None:  # Slurm's preemption notice arrives during the second step
            steps.append(1)
            if len(steps) == 2:
                os.kill(os.getpid(), signal.SIGUSR2)

        return SteppingEngine(run, on_step)

    # under submitit: slurm_task raises, so the task exits non-zero and Slurm shows FAILED
    monkeypatch.setattr("batchinfer.launch.run_shards", lambda r, s: run_shards(r, s, engine=preempted_engine()))
    with pytest.raises(RequeueFailed, match=r"scontrol requeue 77_0 failed: .*presently disabled for job 77_0"):
        slurm_task(str(run.path), [0])
    committed = run.shard_folder(0).read_rows().num_rows
    assert 0 < committed < 30 and not run.shard_folder(0).is_done()  # rows were committed before the requeue
    # under plain sbatch (slurm/batchinfer.sbatch runs `batchinfer worker DIR TASK`): exit 1, one line
    monkeypatch.setattr(
        "batchinfer.launch.local.run_task", lambda d, t: run_shards(RunDir(d), [t], engine=preempted_engine())
    )
    code, _, err = cli(["worker", str(run.path), "0"], capsys)
    assert code == 1 and "batchinfer: error: scontrol requeue 77_0 failed" in err and "Traceback" not in err
    assert run.shard_folder(0).read_rows().num_rows > committed


def test_sbatch_refusing_gres_says_which_setting_and_dir_stays_usable(
    tmp_path: Path, fake_bin: Any, capsys: pytest.CaptureFixture
) -> None:
    sbatch = fake_bin("sbatch", 'echo "sbatch: error: Invalid generic resource (gres) specification" >&2; exit 1')
    code, out, err = cli(["submit", *overrides(tmp_path, 6)], capsys)  # the preset's one GPU per task
    assert code == 2 and "Traceback" not in err and "FailedJobError" not in err
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("[batchinfer ")]  # log lines
    assert len(lines) == 1, err
    assert lines[0].startswith("batchinfer: error: sbatch refused array 0 of 1 of submission 0: ")
    assert (
        "Invalid generic resource (gres) specification" in lines[0]
        and f"batchinfer resume {tmp_path}/run cluster.gpus_per_task=0" in lines[0]
    )
    assert "Nothing of this submission was queued" in lines[0]
    # the same run directory, corrected settings: resume submits
    sbatch.write_text(f'#!/bin/sh\n{SUBMITTED}echo "Submitted batch job $((500 + n))"\n')
    code, out, err = cli(["resume", str(tmp_path / "run"), "cluster.gpus_per_task=0"], capsys)
    assert code == 0, err
    assert "(job 500); merge job 501" in out
    subs = submissions(RunDir(tmp_path / "run"))
    assert [(s["submission"], s["complete"], s["merge"]) for s in subs] == [(0, False, None), (1, True, "501")]
    assert subs[1]["arrays"] == [{"job_id": "500", "tasks": {"0": [0]}}]
    assert subs[0]["name"] != subs[1]["name"] and subs[1]["name"].startswith("bi-")
    script = next((tmp_path / "run/logs/submission-001").glob("500_*submission.sh")).read_text()
    assert f"--job-name={subs[1]['name']}" in script and "gpus-per-task" not in script


def test_second_array_refused_first_one_recorded_and_cancelled(
    tmp_path: Path, fake_bin: Any, capsys: pytest.CaptureFixture
) -> None:
    fake_bin("scontrol", 'echo "MaxArraySize            = 2"')  # 3 tasks: arrays of 2 and 1
    refusal = "sbatch: error: Batch job submission failed: Job violates accounting/QOS policy (job submit limit)"
    fake_bin(
        "sbatch", f'{SUBMITTED}[ "$n" = 0 ] || {{ echo "{refusal}" >&2; exit 1; }}; echo "Submitted batch job 123"'
    )
    ov = overrides(tmp_path, 9, "sharding.num_shards=3", "cluster.gpus_per_task=0")
    code, _, err = cli(["submit", *ov], capsys)
    assert code == 2 and "Traceback" not in err
    assert "sbatch refused array 1 of 2 of submission 0: " + refusal in err and "cluster.qos" in err
    assert "Already queued: array 123 (shards [0, 1])" in err and "batchinfer cancel" in err
    run = RunDir(tmp_path / "run")
    lines = [json.loads(ln) for ln in (run.path / "jobs.jsonl").read_text().splitlines()]
    assert lines[1] == {"submission": 0, "array": 0, "job_id": "123", "tasks": {"0": [0], "1": [1]}}
    code, out, _ = cli(["cancel", str(run.path)], capsys)
    assert code == 0 and "cancelled 1 jobs" in out
    calls = (fake_bin.folder / "scancel.calls").read_text().splitlines()
    name = submissions(run)[0]["name"]
    assert (
        calls[0] == "--verbose 123"
        and calls[1] == f"--name={name} --user={os.environ.get('USER') or calls[1].split('=')[-1]}"
    )


def test_timed_out_sbatch_names_the_job_status_finds_it_by_name(
    tmp_path: Path, fake_bin: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    fake_bin("sbatch", "exec sleep 1000")
    monkeypatch.setattr(executor, "SBATCH_TIMEOUT_S", 0.5)
    code, _, err = cli(["submit", *overrides(tmp_path, 4, "cluster.gpus_per_task=0")], capsys)
    run = RunDir(tmp_path / "run")
    name = submissions(run)[0]["name"]
    assert code == 1 and "Traceback" not in err
    assert (
        f"Slurm did not answer (sbatch: timed out after 0.5 s); the job may have been created all the same, under the name {name}"
        in err
    )
    # the job did get created: squeue lists it under the submission's name
    fake_bin("squeue", f'echo "321_0|321|PENDING|{name}"; echo "999_0|999|RUNNING|someone-else"')
    code, out, _ = cli(["status", str(run.path)], capsys)
    assert code == 0 and "found by job name: 321_0 PENDING" in out and "999" not in out
    code, _, err = cli(["resume", str(run.path)], capsys)
    assert code == 2 and "321_0 PENDING" in err


def test_status_shows_failures_per_submission(tmp_path: Path, fake_bin: Any, capsys: pytest.CaptureFixture) -> None:
    run = prepare(compose(overrides(tmp_path, 12, "sharding.num_shards=2")))
    sub = {"submission": 0, "time": 1.0, "folder": str(run.logs_dir / "submission-000"), "name": "bi-x-0"}
    lines = [sub, {"submission": 0, "array": 0, "job_id": "8", "tasks": {"0": [0], "1": [1]}}]
    lines += [{"submission": 0, "merge": "9"}]
    (run.path / "jobs.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    for index, progress in enumerate(
        [
            {"rows_done": 0, "failures": 3, "failures_by_job": {"5": 2, "8": 1}, "last_error": "EngineDead: boom"},
            {"rows_done": 0, "failures": 1, "last_error": "EngineDead: bang"},  # written before failures_by_job
        ]
    ):
        run.shard_dir(index).mkdir(parents=True)
        run.shard_folder(index).progress_path.write_text(json.dumps(progress))
    code, out, _ = cli(["status", str(run.path)], capsys)
    assert code == 0 and "Slurm did not answer" not in out
    assert "failed 3 times (1 in this submission); EngineDead: boom" in out
    assert "failed 1 time; EngineDead: bang" in out
