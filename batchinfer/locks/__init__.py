"""Locks on a run directory: one writer per shard (`ShardLock`), one merge per run directory
(`RunLock`), on cluster filesystems whose flock may fail or lock only within one node.

Owns: the lock itself and its two mechanisms (lock.py: flock, else the lock file), the lock-file
protocol with its takeover that cannot succeed twice (lockfile.py), the holder record and this
process's identity (holder.py), judging whether a recorded holder may still write by host, pid
and Slurm job state (judge.py), what the filesystem's flock does (filesystems.py), and the mode a
run directory configures (mode.py). The caller that knows the run directory reads the mode
(`configured_mode`) and passes it in: a lock never reads run.yaml. On disk: `<lock>` (flock and
the holder's JSON record) and `<lock>.excl` (the lock file), as DESIGN.md's one writer per shard."""

from batchinfer.locks.filesystems import flock_works, node_local_flock
from batchinfer.locks.holder import Holder, Judgement, Verdict, holder_info
from batchinfer.locks.judge import judge_holder
from batchinfer.locks.lock import RunLock, ShardLock
from batchinfer.locks.mode import LOCK_MODES, configured_mode

__all__ = [
    "LOCK_MODES",
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
