"""How many lines a text file has (all, or those JSON lines rows are made of), and how long the
longest of a chunk's lines is."""

from __future__ import annotations

import re
from pathlib import Path

from batchinfer.inputs.compressed import open_text

# A newline that ends a line of JSON whitespace only (RapidJSON's: space, tab, CR), the next newline not consumed.
_BLANK_LINE = re.compile(rb"\n[ \t\r]*(?=\n)")


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


def longest_line(chunk: bytes) -> int:
    """The length in bytes of the longest line of chunk (its newline apart)."""
    import numpy as np

    ends = np.flatnonzero(np.frombuffer(chunk, np.uint8) == 10)
    bounds = np.concatenate(([-1], ends, [len(chunk)]))
    return int(np.diff(bounds).max()) - 1 if len(chunk) else 0
