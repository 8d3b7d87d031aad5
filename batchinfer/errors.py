"""Errors users see: each says what is wrong and what to do."""


class BatchinferError(Exception):
    """Base for errors shown to the user without a traceback."""

    exit_code = 2  # the command was wrong (config, input); runtime failures use 1


class ConfigError(BatchinferError):
    """A config key or value is wrong."""


class InputError(BatchinferError):
    """The input file cannot be used; names file, line or row."""


class RunDirError(BatchinferError):
    """The run directory refuses the operation (fingerprint, lock, incomplete)."""


class StorageError(BatchinferError):
    """The run directory cannot be written (disk full, quota, read-only); committed data is intact."""

    exit_code = 1


class EngineFailure(BatchinferError):
    """The engine died while generating; committed rows are safe and a rerun resumes."""

    exit_code = 1
