"""The Slurm job this process runs in, read from its environment in one place (as submitit's
JobEnvironment is the one reader of it): job id, array task, restart count, cluster."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

# The variables that make a process act as its Slurm job (requeue it, judge locks by it).
IDENTITY_KEYS = ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_RESTART_COUNT")


def without_job(environ: Mapping[str, str]) -> dict[str, str]:
    """environ without the job identity: for a child that runs inside the job but must never act
    as it (a tune trial: a failed rung is a row of the table, never `scontrol requeue` of the tune job)."""
    return {k: v for k, v in environ.items() if k not in IDENTITY_KEYS}


@dataclass(frozen=True)
class SlurmEnv:
    """What Slurm says about this process's job; every field None (restart 0) outside Slurm."""

    job_id: Optional[str]  # SLURM_JOB_ID: an array task has its own
    array_job_id: Optional[str]  # SLURM_ARRAY_JOB_ID: the array's id, shared by its tasks
    array_task_id: Optional[str]  # SLURM_ARRAY_TASK_ID
    restart_count: int  # SLURM_RESTART_COUNT: runs of this job before this one (requeues)
    cluster: Optional[str]  # SLURM_CLUSTER_NAME: job ids are unique only within a cluster

    @classmethod
    def read(cls, environ: Mapping[str, str] = os.environ) -> SlurmEnv:
        """The job identity in environ (the process's environment by default)."""
        restart = environ.get("SLURM_RESTART_COUNT") or "0"
        return cls(
            job_id=environ.get("SLURM_JOB_ID") or None,
            array_job_id=environ.get("SLURM_ARRAY_JOB_ID") or None,
            array_task_id=environ.get("SLURM_ARRAY_TASK_ID") or None,
            # A value Slurm never writes counts as a first run, not a crash of the caller.
            restart_count=int(restart) if restart.isdigit() else 0,
            cluster=environ.get("SLURM_CLUSTER_NAME") or None,
        )

    @property
    def job(self) -> Optional[str]:
        """This task's id as squeue and scontrol take it: ARRAYJOB_TASK for an array task, else
        the job id; a requeued task keeps it."""
        if self.array_job_id and self.array_task_id:
            return f"{self.array_job_id}_{self.array_task_id}"
        return self.job_id

    @property
    def submission(self) -> Optional[str]:
        """The id shared by every task of one submission: the array job id, else the job id."""
        return self.array_job_id or self.job_id


def current() -> SlurmEnv:
    """The Slurm job identity of this process, read now (tests and srun steps change it)."""
    return SlurmEnv.read()
