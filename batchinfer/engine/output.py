"""Keep the engine's console noise in a log file while batchinfer's own lines stay on the console.

vLLM's start-up lines (Triton, NUMA, oneDNN, FutureWarnings) come partly from its engine-core
subprocess and from native code writing straight to file descriptors 1 and 2, which Python
logging cannot catch. So while an engine runs, descriptors 1 and 2 point at
DIR/logs/engine-<host>-<pid>.log (the engine's processes inherit them), and batchinfer's logger
and progress bar write to copies of the original console descriptors. Setting
VLLM_LOGGING_LEVEL asks for everything on the console, as before.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Optional

from batchinfer.errors import BatchinferError, EngineFailure, Stopped

log = logging.getLogger("batchinfer")

# Read before anything of ours sets it for vLLM: a value here is the user's own request.
USER_VLLM_LOGGING_LEVEL = os.environ.get("VLLM_LOGGING_LEVEL")
TAIL_LINES = 40


def engine_log_path(logs_dir: Path) -> Path:
    """Where this process's engine output goes."""
    return logs_dir / f"engine-{socket.gethostname()}-{os.getpid()}.log"


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    """The last lines of a text file (empty if it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _fileno(stream: Any) -> Optional[int]:
    try:
        return int(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return None  # pytest's capsys, a StringIO: not a descriptor we move


class EngineOutput:
    """While entered, descriptors 1 and 2 go to the engine log; `console` writes to the terminal."""

    def __init__(self, logs_dir: Path, enabled: bool = True):
        self.path: Optional[Path] = engine_log_path(logs_dir) if enabled and USER_VLLM_LOGGING_LEVEL is None else None
        self.console: IO[str] = sys.stderr
        self._saved: dict[int, int] = {}
        self._streams: list[tuple[logging.StreamHandler, Any]] = []  # type: ignore[type-arg]

    def __enter__(self) -> EngineOutput:
        if self.path is None:
            return self
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
        except OSError as e:
            log.warning("cannot write %s (%s): engine output stays on the console", self.path, e.strerror)
            self.path = None
            return self
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        self._saved = {n: os.dup(n) for n in (1, 2)}
        self.console = os.fdopen(os.dup(self._saved[2]), "w", buffering=1, encoding="utf-8", errors="replace")
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        # vLLM's own loggers stay on sys.stdout (now the file): INFO there costs nothing on the console.
        os.environ["VLLM_LOGGING_LEVEL"] = "INFO"
        for handler in log.handlers:
            if isinstance(handler, logging.StreamHandler) and _fileno(handler.stream) in (1, 2):
                self._streams.append((handler, handler.setStream(self.console)))
        log.info("engine output goes to %s (VLLM_LOGGING_LEVEL=INFO shows it here instead)", self.path)
        return self

    def bar_file(self) -> IO[str]:
        """Where a progress bar writes: the console, not the engine log."""
        return self.console if self._saved and _fileno(sys.stderr) in (1, 2) else sys.stderr

    def __exit__(
        self, kind: Optional[type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        if self.path is None:
            return
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        for n, saved in self._saved.items():
            os.dup2(saved, n)
            os.close(saved)
        for handler, stream in self._streams:
            handler.setStream(stream)
        os.environ.pop("VLLM_LOGGING_LEVEL", None)
        if exc is not None and _engine_failure(exc):
            lines = tail(self.path)
            if lines:
                log.error("last lines of the engine log %s:\n%s", self.path, lines)
            else:
                log.error("engine log: %s", self.path)
        self.console.close()


def _engine_failure(exc: BaseException) -> bool:
    """Whether an exception may come from the engine (not a stop, nor bad input or config)."""
    if isinstance(exc, (Stopped, KeyboardInterrupt)):
        return False
    return isinstance(exc, EngineFailure) or not isinstance(exc, BatchinferError)
