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
        return _Zstd(path)

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


class _Zstd(io.RawIOBase):
    """A zstd file's frames decompressed in turn; a file that ends inside a frame raises ZstdError
    (zstandard's stream_reader returns what it has as if the file ended there: a corpus cut short
    in transfer would be read as a shorter one)."""

    def __init__(self, path: Path) -> None:
        import zstandard

        super().__init__()
        self.file = open(path, "rb")
        self.dctx = zstandard.ZstdDecompressor()
        self.frame = self.dctx.decompressobj()
        self.inside = False  # bytes of the current frame were fed and its end not seen yet
        self.out = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        while not len(self.out):
            data = self.file.read(1 << 20)
            if not data:
                if self.inside:
                    import zstandard

                    raise zstandard.ZstdError("the file ends inside a zstd frame")
                return 0
            self.out = memoryview(self._feed(data))
        n = min(len(buf), len(self.out))
        buf[:n] = self.out[:n]
        self.out = self.out[n:]
        return n

    def _feed(self, data: bytes) -> bytes:
        parts = []
        while data:
            parts.append(self.frame.decompress(data))
            self.inside = not self.frame.eof
            if not self.frame.eof:
                break
            data = self.frame.unused_data  # the next frame's first bytes, if any
            self.frame = self.dctx.decompressobj()
        return b"".join(parts)

    def close(self) -> None:
        if not self.closed:
            self.file.close()
        super().close()
