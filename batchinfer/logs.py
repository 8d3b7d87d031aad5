"""batchinfer's own log lines: one format for the CLI, the local run and Slurm tasks."""

from __future__ import annotations

import logging
import sys

from batchinfer.redaction import RedactingFilter

log = logging.getLogger("batchinfer")


def setup_logging() -> None:
    """Plain timestamped lines on stderr for batchinfer's own logger (vLLM keeps its own)."""
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[batchinfer %(asctime)s] %(message)s", "%H:%M:%S"))
        handler.addFilter(RedactingFilter())  # a log line with a command line or a config value
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def plural(count: int, word: str) -> str:
    """COUNT and WORD, with an s unless COUNT is 1: `1 shard`, `4 shards`, `1,200 rows`."""
    return f"{count:,} {word}{'' if count == 1 else 's'}"
