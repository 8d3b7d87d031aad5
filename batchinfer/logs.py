"""batchinfer's own log lines: one format for the CLI, the local run and Slurm tasks; every line
printed or logged goes through the redaction (redaction.redact_text)."""

from __future__ import annotations

import io
import logging
import sys
from typing import Any, TextIO

from batchinfer.redaction import redact_printed, redact_text

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


class RedactingStream(io.TextIOBase):
    """A text stream (stdout, stderr) whose every write is redacted first; the rest is the stream's."""

    def __init__(self, stream: TextIO):
        self._stream = stream

    def write(self, text: str) -> int:  # type: ignore[override]
        """Redact, then write."""
        self._stream.write(redact_printed(text))  # a --json document stays JSON
        return len(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def flush(self) -> None:
        """Flush the wrapped stream."""
        self._stream.flush()

    def isatty(self) -> bool:
        """Whether the wrapped stream is a terminal (tqdm asks)."""
        return self._stream.isatty()

    def fileno(self) -> int:
        """The wrapped stream's descriptor."""
        return self._stream.fileno()


def redacting_console() -> None:
    """Redact everything this process prints to stdout and stderr (idempotent)."""
    if not isinstance(sys.stdout, RedactingStream):
        sys.stdout = RedactingStream(sys.stdout)  # type: ignore[assignment]
    if not isinstance(sys.stderr, RedactingStream):
        sys.stderr = RedactingStream(sys.stderr)  # type: ignore[assignment]


class RedactingFilter(logging.Filter):
    """A logging filter that redacts each record's message (its arguments filled in first)."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Redact the message in place; keep the record."""
        record.msg, record.args = redact_text(record.getMessage()), None
        return True
