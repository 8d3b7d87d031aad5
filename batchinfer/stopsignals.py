"""The signals that stop a task, in one place for the worker, the supervisor and the local run.

USR2 is Slurm's notice before preemption or the time limit (`--signal=B:USR2@lead`): commit and
requeue. TERM is `scancel` (or the time limit itself) and INT a Ctrl-C: commit and stop."""

from __future__ import annotations

import signal

REQUEUE_SIGNAL = signal.SIGUSR2
STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)
