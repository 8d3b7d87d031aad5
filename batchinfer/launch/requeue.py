"""When a task asks Slurm to run it again: after a stop signal (USR2: the time limit or a
preemption is near) and after a shard's failure, while cluster.max_attempts allows. One policy for
a task with one engine (launch/local.py) and one with several (launch/engines.py)."""

from __future__ import annotations

import logging
from typing import Any, Optional

from batchinfer.errors import RequeueFailed
from batchinfer.launch import slurm
from batchinfer.rundir.store import RunDir
from batchinfer.stopsignals import REQUEUE_SIGNAL

log = logging.getLogger("batchinfer")


def requeue_on_stop(signum: int) -> None:
    """USR2 under Slurm (time limit, preemption): requeue this task; TERM (scancel), INT: just stop.

    Rows are committed by now. A requeue that fails raises RequeueFailed, so the task ends FAILED
    with the reason instead of COMPLETED with its shards unfinished."""
    if signum == REQUEUE_SIGNAL and slurm.this_job():
        slurm.requeue_task()


def earns_another_attempt(run: RunDir, index: int, failures: Optional[int], error: Any, who: str = "") -> bool:
    """Whether a failed shard earns the task another attempt (cluster.max_attempts per submission);
    says why in the log. failures: the shard's failures in this submission, counted under its lock."""
    limit = run.config.cluster.max_attempts
    if failures is None:
        log.error("%sshard %d failed outside its shard lock (%s): not requeueing", who, index, error)
        return False
    if failures < limit:
        log.error("%sshard %d failed (%s), attempt %d of %d: requeueing", who, index, error, failures, limit)
        return True
    log.error("%sshard %d failed %d times in this submission (cluster.max_attempts): giving up", who, index, failures)
    return False


def requeue_for_another_attempt() -> bool:
    """Requeue this task after a failure; False outside Slurm or when scontrol fails (logged: the
    task then ends with the failure itself, which is what the user needs to see)."""
    if not slurm.this_job():
        return False
    try:
        slurm.requeue_task()
    except RequeueFailed as e:
        log.error("%s", e)
        return False
    return True
