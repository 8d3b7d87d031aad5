"""Locks on a run directory: one writer per shard, one merge per run directory (see lock.py)."""

from batchinfer.rundir.locks.lock import (
    LOCK_MODES,
    FileLock,
    Holder,
    Judgement,
    RunLock,
    ShardLock,
    Verdict,
    configured_mode,
    flock_works,
    holder_info,
    judge_holder,
    node_local_flock,
)

__all__ = [
    "LOCK_MODES",
    "FileLock",
    "Holder",
    "Judgement",
    "RunLock",
    "ShardLock",
    "Verdict",
    "configured_mode",
    "flock_works",
    "holder_info",
    "judge_holder",
    "node_local_flock",
]
