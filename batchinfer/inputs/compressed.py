"""Reading a possibly compressed input file (gzip, bzip2, xz, zstd by its suffix), the codecs'
errors said as one InputError naming the file."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from batchinfer.errors import InputError

COMPRESSION_SUFFIXES = (".gz", ".zst", ".bz2", ".xz")


def open_text(path: Path) -> Any:
    """Open a possibly compressed file for binary reading, by its suffix; compressed data that is
    corrupt, cut short or not compressed at all raises InputError naming the file."""
    name = path.name.lower()
    if not name.endswith(COMPRESSION_SUFFIXES):
        return open(path, "rb")
    import io

    return io.BufferedReader(_Decompressed(path), buffer_size=1 << 20)


class _Decompressed(io.RawIOBase):
    """A compressed file's decompressed bytes, the codec's errors (EOFError, zlib.error,
    ZstdError, ...) said once as InputError: which file, and what to do."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self.inner = self._open(path)

    @staticmethod
    def _open(path: Path) -> Any:
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
        import zstandard

        return zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        try:
            return self.inner.readinto(buf)
        except Exception as e:  # each codec has its own errors (OSError, EOFError, zlib.error, ZstdError, ...)
            raise compressed_error(self.path, e) from None

    def close(self) -> None:
        if not self.closed:
            self.inner.close()
        super().close()


def compressed_error(path: Path, e: BaseException) -> InputError:
    """A compressed input whose data cannot be decompressed: the file, the codec's words, what to do."""
    codec = path.suffix.lower().lstrip(".")
    reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    return InputError(
        f"{path}: cannot be decompressed as {codec} ({reason}); the file is cut short, corrupt or not {codec} "
        f"data: copy it again, or rename it without {path.suffix} if it is not compressed"
    )
