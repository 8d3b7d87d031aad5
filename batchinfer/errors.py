"""Errors users see: each says what is wrong and what to do; and Stopped, which is no error."""

import signal


class BatchinferError(Exception):
    """Base for errors shown to the user without a traceback."""

    exit_code = 2  # the command was wrong (config, input); runtime failures use 1


class ConfigError(BatchinferError):
    """A config key or value is wrong."""


class InputError(BatchinferError):
    """The input file cannot be used; names file, line or row."""


class RunDirError(BatchinferError):
    """The run directory refuses the operation (fingerprint, lock, incomplete)."""


class FolderRefused(RunDirError):
    """A folder batchinfer may not take: another's (a user's, another tool's), or one another live
    command is making; one line naming the folder and its holder (ownership.py)."""


class CorruptRecord(RunDirError, ValueError):
    """A record batchinfer wrote whole (plan.json, stats.json, ...) that is not JSON now: something
    else changed or cut it. Names the file and what to do (a ValueError, as json's own error is)."""


class TransientRunDirError(RunDirError):
    """A refusal that may pass by itself (Slurm did not answer about a lock's holder, run.yaml could
    not be read just now): the shard loop tries again before giving up."""


class StorageError(BatchinferError):
    """The run directory cannot be written (disk full, quota, read-only); committed data is intact."""

    exit_code = 1


class EngineFailure(BatchinferError):
    """The engine died while generating; committed rows are safe and a rerun resumes."""

    exit_code = 1


class SlurmUnavailable(BatchinferError):
    """A Slurm command did not answer in time (or at all); names the command and the timeout."""

    exit_code = 1

    def __init__(self, command: str, reason: str, hint: str = ""):
        self.command = command
        self.reason = reason
        super().__init__(f"Slurm did not answer ({self.short})" + (f"; {hint}" if hint else ""))

    @property
    def short(self) -> str:
        """`command: reason`, for one-line notes."""
        return f"{self.command}: {self.reason}"


class SubmissionRefused(BatchinferError):
    """sbatch refused a submission; quotes sbatch and names the cluster.* setting to change."""


class RequeueFailed(BatchinferError):
    """`scontrol requeue` of this task failed: the task must exit non-zero, not COMPLETED."""

    exit_code = 1


class Stopped(Exception):
    """A stop signal arrived; committed work is safe, the rest is left for resume. Not a
    BatchinferError: a stop is not a failure (no attempt is counted), and the CLI exits 128 + signal."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum
