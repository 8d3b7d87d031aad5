"""Errors users see: each says what is wrong and what to do."""


class BatchinferError(Exception):
    """Base for errors shown to the user without a traceback."""


class ConfigError(BatchinferError):
    """A config key or value is wrong."""


class InputError(BatchinferError):
    """The input file cannot be used; names file, line or row."""


class RunDirError(BatchinferError):
    """The run directory refuses the operation (fingerprint, lock, incomplete)."""
