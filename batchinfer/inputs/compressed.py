"""Reading a possibly compressed input file (gzip, bzip2, xz, zstd by its suffix)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

COMPRESSION_SUFFIXES = (".gz", ".zst", ".bz2", ".xz")


def open_text(path: Path) -> Any:
    """Open a possibly compressed file for binary reading, by its suffix."""
    name = path.name.lower()
    if name.endswith(".gz"):
        import gzip

        return gzip.open(path, "rb")
    if name.endswith(".bz2"):
        import bz2

        return bz2.open(path, "rb")
    if name.endswith(".xz"):
        import lzma

        return lzma.open(path, "rb")
    if name.endswith(".zst"):
        import io

        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb")))
    return open(path, "rb")
