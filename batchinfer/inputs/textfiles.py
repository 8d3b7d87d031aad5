"""Reading text inputs line by line: compressed files, UTF-8 with file:line errors, JSON lines checks."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from batchinfer.errors import InputError

COMPRESSION_SUFFIXES = (".gz", ".zst", ".bz2", ".xz")
# A newline that ends a line of JSON whitespace only (RapidJSON's: space, tab, CR), the next newline not consumed.
_BLANK_LINE = re.compile(rb"\n[ \t\r]*(?=\n)")
# A \uD800-\uDFFF escape: half of a UTF-16 pair (checked further only where one appears).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def first_line(path: Path) -> str:
    """The first non-empty line of a (possibly compressed) text file, or ''."""
    try:
        with open_text(path) as f:
            for raw in f:
                if raw.strip():
                    return raw.decode("utf-8", errors="replace").removeprefix("\ufeff")
    except OSError:
        pass
    return ""


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


def text_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of a (possibly compressed) UTF-8 file, a leading BOM dropped; a line that is
    not UTF-8 raises InputError naming file:line and the byte."""
    offset = 0
    compressed = path.name.lower().endswith(COMPRESSION_SUFFIXES)
    with open_text(path) as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                # Offsets in a compressed file would point into its decompressed text: the line is enough.
                where = "" if compressed else f", file offset {offset + e.start}"
                raise InputError(
                    f"{path}:{lineno}: invalid UTF-8 at byte {e.start} of the line{where}; re-encode the file as UTF-8"
                ) from None
            offset += len(raw)
            yield lineno, line.removeprefix("\ufeff") if lineno == 1 else line


def json_object(path: Path, lineno: int, line: str) -> dict[str, Any]:
    """One JSON lines row; errors name file:line."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise InputError(
            f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno}); fix or remove the line"
        ) from None
    if not isinstance(obj, dict):
        raise InputError(f"{path}:{lineno}: expected a JSON object per line, got {type(obj).__name__}")
    if _SURROGATE_ESCAPE.search(line):
        _refuse_lone_surrogates(path, lineno, obj)
    return obj


def _refuse_lone_surrogates(path: Path, lineno: int, obj: dict[str, Any]) -> None:
    """InputError naming file:line and the field where a string holds half a UTF-16 pair (not text)."""
    for key, value in obj.items():
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            bad = e.object[e.start : e.end]
            raise InputError(
                f"{path}:{lineno}: field {key!r} holds a lone UTF-16 surrogate ({bad.encode('unicode_escape').decode()}), "
                "which is not text; replace it (e.g. with \\ufffd) or remove it"
            ) from None


def scan_jsonl(path: Path) -> int:
    """Check every line decodes and parses; return the row count. Errors name file:line."""
    rows = 0
    for lineno, line in text_lines(path):
        if line.strip():
            json_object(path, lineno, line)
            rows += 1
    return rows


def count_lines(path: Path, exact: bool = False) -> int:
    """Lines of a (possibly compressed) text file, a last one without a newline included. exact=True
    counts only lines with something besides JSON whitespace, the rows a JSON lines reader makes."""
    if exact:
        return _lines_with_content(path)
    import numpy as np

    # numpy counts without holding the GIL, so this can run beside a conversion; bytes.count is 2x slower.
    newlines = 0
    buf = bytearray(1 << 24)
    last = 10
    with open_text(path) as f:
        while n := f.readinto(buf):
            newlines += int(np.count_nonzero(np.frombuffer(buf, np.uint8, n) == 10))
            last = buf[n - 1]
    return newlines + (last != 10)


def _lines_with_content(path: Path) -> int:
    newlines = blank = 0
    # Whether the line still open at a block's end has content so far; its bytes are not kept.
    open_line = b""
    with open_text(path) as f:
        while block := f.read(1 << 24):
            newlines += block.count(b"\n")
            cut = block.rfind(b"\n")
            if cut < 0:
                open_line = open_line or (b"x" if block.strip(b" \t\r") else b"")
                continue
            # The leading newline lets the pattern see the block's first line as a whole one.
            blank += len(_BLANK_LINE.findall(b"\n" + open_line + block[: cut + 1]))
            open_line = b"x" if block[cut + 1 :].strip(b" \t\r") else b""
    return newlines - blank + (open_line == b"x")


def csv_header(path: Path, sep: str) -> list[str]:
    """The column names on a CSV/TSV file's first line (a UTF-8 BOM dropped)."""
    import csv
    import io

    with open_text(path) as f:
        head = io.TextIOWrapper(f, encoding="utf-8-sig", errors="replace", newline="")
        return next(csv.reader(head, delimiter=sep), [])
