"""Slurm's job states have one home (batchinfer/slurm_states.py), and the three readers sort each
state alike: a lock's holder (alive?), `status` (running, pending, failed) and `resume` (does a job
of DIR still run or wait?). SUSPENDED, decided once: alive, active, shown pending, not queued."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support.fake_slurm import overrides

from batchinfer.config.compose import compose
from batchinfer.insight.status import shard_status
from batchinfer.launch.submit import active_jobs
from batchinfer.locks.holder import Holder, Verdict
from batchinfer.locks.judge import judge_holder
from batchinfer.rundir.prepare import prepare
from batchinfer.slurm_states import ACTIVE, ALIVE, FINAL, PAUSED, QUEUED, RUNNING


def test_each_state_has_one_kind_and_suspended_is_alive_but_not_queued() -> None:
    kinds = [QUEUED, RUNNING, PAUSED, FINAL]
    assert all(not a & b for i, a in enumerate(kinds) for b in kinds[i + 1 :])
    assert "SUSPENDED" in ALIVE and "SUSPENDED" in ACTIVE
    assert "SUSPENDED" not in QUEUED and "SUSPENDED" not in RUNNING
    assert ALIVE == RUNNING | PAUSED and ACTIVE == QUEUED | ALIVE and not ACTIVE & FINAL


@pytest.mark.parametrize(
    "state, alive, shown",
    [
        ("SUSPENDED", True, "pending"),
        ("STOPPED", True, "pending"),
        ("RESIZING", True, "running"),
        ("SIGNALING", True, "running"),
        ("COMPLETING", True, "running"),
        ("PENDING", False, "pending"),
        ("REQUEUED", False, "pending"),
        ("TIMEOUT", False, "failed"),
    ],
)
def test_locks_status_and_resume_read_a_state_alike(
    state: str, alive: bool, shown: str, tmp_path: Path, fake_bin: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_CLUSTER_NAME"):
        monkeypatch.delenv(var, raising=False)
    # a lock held by task 700_0 on another node: squeue -h -j 700_0 -o %T
    fake_bin("squeue", f"echo {state}")
    judgement = judge_holder(Holder(host="other-node", pid=7, slurm_job="700_0"))
    assert (judgement.verdict is Verdict.ALIVE) is alive, judgement
    # status: shard 0 was given to task 700_0
    run = prepare(compose(overrides(tmp_path, 6)))
    record = {"submission": 0, "time": 1.0, "folder": str(tmp_path), "name": "bi-test", "merge": "701"}
    record["arrays"] = [{"job_id": "700", "tasks": {"0": [0]}}]
    (run.path / "jobs.jsonl").write_text(json.dumps(record) + "\n")
    assert shard_status(run, {"700_0": state})[0]["state"] == shown
    # resume: this user's jobs as squeue lists them (%i|%A|%T|%j)
    fake_bin("squeue", f'echo "700_0|700|{state}|bi-test"')
    assert active_jobs(run) == ({"700_0": state} if alive or state in QUEUED else {})
