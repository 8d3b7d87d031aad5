"""The input's identity recorded in the run: footers for a corpus read in place, else a content hash."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import Any, Optional

from batchinfer.inputs.reference import plan_reference, reference_fingerprint


def file_fingerprint(
    files: list[Path],
    previous: Optional[dict[str, Any]] = None,
    fmt: Optional[str] = None,
    stop: Optional[threading.Event] = None,
) -> dict[str, Any]:
    """The input's identity: for a Parquet or Arrow corpus read in place its footers and sizes (the
    data is not read), else a content hash of every file; reused when names, sizes and mtimes match
    the previous record. A record from before footers (no `method`) stays a content hash. Setting
    stop ends the hash early (FingerprintJob.cancel)."""
    members = sorted(f for p in files for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file())
    stats = [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in members]
    if previous and previous.get("files") == stats:
        return previous
    size = sum(s[1] for s in stats)
    manifest = plan_reference(files, fmt) if fmt and (previous is None or "method" in previous) else None
    if manifest is not None:
        return {
            "files": stats,
            "size": size,
            "fingerprint": reference_fingerprint(manifest, files),
            "method": "footers",
        }
    h = hashlib.blake2b(digest_size=16)
    for f in members:
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            while block := fh.read(1 << 20):
                h.update(block)
                if stop is not None and stop.is_set():
                    raise _Cancelled
    return {"files": stats, "size": size, "fingerprint": h.hexdigest()}


class _Cancelled(Exception):
    """The fingerprint was no longer wanted."""


class FingerprintJob:
    """`file_fingerprint` in a thread beside other work (the input's conversion): hashlib hashes
    without holding the GIL, so a core that pyarrow's parse leaves idle hashes the input meanwhile
    instead of before it. A context manager: leaving it stops a hash nobody waited for."""

    def __init__(self, files: list[Path], previous: Optional[dict[str, Any]], fmt: Optional[str]) -> None:
        self._stop = threading.Event()
        self._record: Optional[dict[str, Any]] = None
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(
            target=self._run, args=(files, previous, fmt), name="batchinfer-fingerprint", daemon=True
        )
        self._thread.start()

    def _run(self, files: list[Path], previous: Optional[dict[str, Any]], fmt: Optional[str]) -> None:
        try:
            self._record = file_fingerprint(files, previous, fmt, self._stop)
        except BaseException as e:  # raised to whoever asks for the result
            self._error = e

    def result(self) -> dict[str, Any]:
        """The fingerprint record, once the hash is done; its error, if it failed."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._record is not None
        return self._record

    def __enter__(self) -> FingerprintJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
