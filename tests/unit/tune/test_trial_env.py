"""A trial inside a tune job runs without the job's identity: its failed rung or a stop signal
must never `scontrol requeue` the tune job (the tune job is never requeued)."""

from __future__ import annotations

import pytest

from batchinfer.launch import slurm
from batchinfer.slurm_env import SlurmEnv
from batchinfer.tune.process import trial_env
from batchinfer.tune.settings import Setting


def test_a_trial_in_a_tune_job_is_not_the_job(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in {
        "SLURM_JOB_ID": "4242",
        "SLURM_ARRAY_JOB_ID": "4240",
        "SLURM_ARRAY_TASK_ID": "2",
        "SLURM_RESTART_COUNT": "1",
        "SLURM_CPUS_ON_NODE": "2",
    }.items():
        monkeypatch.setenv(key, value)
    assert slurm.this_job() == "4240_2"  # the tune job itself acts as its job

    env = trial_env(Setting(("model.max_num_seqs=64",), env={"VLLM_CPU_OMP_THREADS_BIND": "0-1"}))

    ident = SlurmEnv.read(env)
    assert (ident.job, ident.job_id, ident.restart_count) == (None, None, 0)  # nothing to requeue
    assert env["SLURM_CPUS_ON_NODE"] == "2"  # the job's resources stay visible to the trial
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"  # the setting's own variables are set
