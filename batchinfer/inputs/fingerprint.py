"""The input's identity recorded in the run: footers for a corpus read in place, else a content hash."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Optional

from batchinfer.inputs.reference import plan_reference, reference_fingerprint


def file_fingerprint(
    files: list[Path], previous: Optional[dict[str, Any]] = None, fmt: Optional[str] = None
) -> dict[str, Any]:
    """The input's identity: for a Parquet or Arrow corpus read in place its footers and sizes (the
    data is not read), else a content hash of every file; reused when names, sizes and mtimes match
    the previous record. A record from before footers (no `method`) stays a content hash."""
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
    return {"files": stats, "size": size, "fingerprint": h.hexdigest()}
