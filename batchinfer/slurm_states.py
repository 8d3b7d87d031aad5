"""Slurm's job states, sorted once for every reader (lock holders, `status`, `resume`, the merge job).

The names are those squeue prints with `%T` and sacct in its State column (sacct adds the user to a
cancel: `CANCELLED by 1000`, so callers take the first word): `man squeue`, JOB STATE CODES.

    QUEUED   waiting for an allocation: PENDING, REQUEUED ("completing job is being requeued"),
             REQUEUE_HOLD, REQUEUE_FED
    RUNNING  holds an allocation and its processes run: RUNNING, CONFIGURING (nodes booting),
             COMPLETING ("some processes on some nodes may still be active"), RESIZING ("about
             to change size"), SIGNALING ("being signaled")
    PAUSED   holds an allocation, its processes exist but do not run: SUSPENDED (suspended, its
             CPUs lent to other jobs), STOPPED (stopped with SIGSTOP, its CPUs kept)
    FINAL    ended: COMPLETED and the failures (FAILED_STATES)

SUSPENDED is decided here, once: its processes exist and go on writing once resumed, so it is
ALIVE for a shard lock's holder (its lock is not taken over) and ACTIVE for `resume` (not
submitted again); `status` shows its shards "pending" (they wait, as queued ones do, and ask
nothing of the user), but it is not QUEUED: it has its allocation."""

from __future__ import annotations

QUEUED = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"})
RUNNING = frozenset({"RUNNING", "CONFIGURING", "COMPLETING", "RESIZING", "SIGNALING"})
PAUSED = frozenset({"SUSPENDED", "STOPPED"})
FAILED_STATES = frozenset(
    {"FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "CANCELLED", "PREEMPTED"}
)
FINAL = FAILED_STATES | {"COMPLETED"}

# A job in these states has processes that may still write (a lock holder in them is alive).
ALIVE = RUNNING | PAUSED
# A job in these states has not ended: it runs, or will (resume refuses while one of DIR's is).
ACTIVE = QUEUED | ALIVE
