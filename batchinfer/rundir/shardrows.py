"""A shard's committed rows checked against its row range (each row once), and its files merged into
row order as a stream: a window of rows at a time, so memory is bounded by the window, not the shard.

Parts are sorted by row at commit, so a window's rows are one run of positions in each part; a file
that is not sorted (parts of earlier versions) is read whole for each window it has rows in (one
file's memory, never the shard's). The row indices themselves (8 bytes a row) are read first, as
the worker already reads them to resume.

A Parquet part is one row group (one page a column), so it cannot be read a window at a time: an
open reader per part holds its decoded pages, i.e. the shard. Given a spill file, Parquet files are
instead read once each, their rows cut by window into an Arrow IPC file (a part's memory), and each
window then reads back its own batches (a window's memory): time O(rows), disk: the shard once more
until sealed."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchinfer.errors import RunDirError
from batchinfer.inputs.shards import Shard
from batchinfer.rundir.schema import jsonl_columns, jsonl_to_table, table_to_jsonl

# JSON lines are read in blocks of about this size (whole lines).
BLOCK_BYTES = 1 << 20
SHOWN = 5  # rows named in a message


@dataclass
class FileRows:
    """One committed file: the row of each of its rows (positions in file order), which copies are
    kept, and (Parquet) where its row groups start."""

    path: Path
    rows: np.ndarray
    keep: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    group_starts: Optional[np.ndarray] = None  # Parquet: first position of each row group, then the count
    nbytes: int = 0  # its rows' size in memory (Parquet: uncompressed; JSONL: the file's)
    ordered: bool = True
    # JSONL, ordered: the next position to read and its byte offset (windows come in row order)
    next_pos: int = 0
    next_offset: int = 0


@dataclass(frozen=True)
class RowCheck:
    """A shard's committed rows against its range: duplicates (each row listed once, with the number
    of extra copies), rows missing, and rows outside the range by file."""

    shard: Shard
    duplicates: np.ndarray
    dropped: int
    missing: np.ndarray
    outside: dict[str, list[int]]

    @property
    def complete(self) -> bool:
        """Every row of the range is committed and none outside it (duplicates aside)."""
        return not len(self.missing) and not self.outside

    @property
    def exact(self) -> bool:
        """Every row of the range committed exactly once, none outside it."""
        return self.complete and not self.dropped

    def duplicates_text(self) -> str:
        """What the duplicates are, for a log line."""
        rows = ", ".join(str(r) for r in self.duplicates[:SHOWN].tolist())
        more = f", ... ({len(self.duplicates)} rows)" if len(self.duplicates) > SHOWN else ""
        return f"{self.dropped} extra copies of rows {rows}{more}"

    def problem(self) -> str:
        """What keeps the shard from being sealed (missing rows, rows outside the range)."""
        out = []
        if len(self.missing):
            shown = ", ".join(str(r) for r in self.missing[:SHOWN].tolist())
            more = ", ..." if len(self.missing) > SHOWN else ""
            out.append(f"{len(self.missing)} rows missing ({shown}{more})")
        for name, rows in self.outside.items():
            out.append(f"{name} holds rows outside the shard ({', '.join(str(r) for r in rows)})")
        if self.dropped:
            out.append(self.duplicates_text())
        return "; ".join(out)


def row_column(path: Path, schema: pa.Schema) -> FileRows:
    """The row index of each row of one committed file, read without its other columns."""
    if path.suffix == ".jsonl":
        chunks = [jsonl_row_block(data, schema) for data in line_blocks(path)]
        rows = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int64)
        return FileRows(path, rows, ordered=_ordered(rows), nbytes=path.stat().st_size)
    with pq.ParquetFile(path) as f:
        groups = [f.metadata.row_group(i) for i in range(f.num_row_groups)]
        rows = f.read(columns=["row"], use_threads=False).column("row").to_numpy().astype(np.int64, copy=False)
    starts = np.concatenate([[0], np.cumsum([g.num_rows for g in groups], dtype=np.int64)])
    nbytes = sum(g.total_byte_size for g in groups)
    return FileRows(path, rows, group_starts=starts, ordered=_ordered(rows), nbytes=nbytes)


def _ordered(rows: np.ndarray) -> bool:
    return bool(len(rows) < 2 or (np.diff(rows) >= 0).all())


def line_blocks(path: Path, block_bytes: int = BLOCK_BYTES) -> Iterator[bytes]:
    """A JSON lines file in blocks of whole lines (about block_bytes each)."""
    with open(path, "rb") as f:
        carry = b""
        while True:
            block = f.read(block_bytes)
            data = carry + block
            cut = data.rfind(b"\n") + 1 if block else len(data)
            data, carry = data[:cut], data[cut:]
            if data.strip():
                yield data
            if not block:
                return


def jsonl_row_block(data: bytes, schema: pa.Schema) -> np.ndarray:
    """The row of each non-blank line of a block of JSON lines."""
    n = sum(1 for line in data.split(b"\n") if line.strip())
    rows = jsonl_columns(data, schema, ["row"]).column("row").to_numpy().astype(np.int64, copy=False)
    if len(rows) != n:
        raise RunDirError(f"{n} JSON lines parsed as {len(rows)} rows")
    return rows


class ShardRows:
    """The committed files of one shard, in commit order, checked against its range; `windows`
    streams them in row order, each row once (the first committed copy)."""

    def __init__(self, shard: Shard, files: list[Path], schema: pa.Schema):
        self.shard = shard
        self.schema = schema
        if len({p.suffix for p in files}) > 1:  # not a layout batchinfer writes: a run has one part format
            raise RunDirError(
                f"shard {shard.index}: Parquet and JSONL files mixed ({', '.join(p.name for p in files)})"
            )
        self.files = [row_column(p, schema) for p in files]
        self.check = self._check()

    def _check(self) -> RowCheck:
        """Mark the first committed copy of each row kept, and what does not fit the range."""
        s = self.shard
        flat = np.concatenate([f.rows for f in self.files]) if self.files else np.zeros(0, dtype=np.int64)
        order = np.argsort(flat, kind="stable")  # stable: copies of a row stay in commit order
        ranked = flat[order]
        first = np.ones(len(ranked), dtype=bool)
        first[1:] = ranked[1:] != ranked[:-1]
        keep = np.zeros(len(flat), dtype=bool)
        keep[order[first]] = True
        inside = (flat >= s.start) & (flat < s.stop)
        keep &= inside
        offset = 0
        outside: dict[str, list[int]] = {}
        for f in self.files:
            f.keep = keep[offset : offset + len(f.rows)]
            wrong = f.rows[~inside[offset : offset + len(f.rows)]]
            if len(wrong):
                outside[f.path.name] = wrong[:SHOWN].tolist()
            offset += len(f.rows)
        extra = ranked[~first]
        present = ranked[first]
        present = present[(present >= s.start) & (present < s.stop)]
        missing = np.setdiff1d(np.arange(s.start, s.stop, dtype=np.int64), present, assume_unique=True)
        return RowCheck(s, np.unique(extra), len(extra), missing, outside)

    @property
    def row_bytes(self) -> float:
        """The mean size of a committed row (for sizing windows)."""
        rows = sum(len(f.rows) for f in self.files)
        return sum(f.nbytes for f in self.files) / rows if rows else 0.0

    @property
    def in_order(self) -> bool:
        """One file, sorted, each row once: it is already the shard's rows in row order."""
        return len(self.files) == 1 and self.files[0].ordered and self.check.exact

    def windows(
        self, size: int, lines: bool, spill: Optional[Path] = None
    ) -> Iterator[tuple[np.ndarray, pa.Table | bytes]]:
        """(rows, their table or JSON lines) of windows of `size` rows in row order; only for a
        complete shard (a missing row raises). spill: a scratch file (the caller removes it) through
        which Parquet files are read once each instead of once a window."""
        if not self.check.complete:
            raise RunDirError(f"shard {self.shard.index}: {self.check.problem()}")
        for f in self.files:
            f.next_pos = f.next_offset = 0
        if spill is not None and self.files and self.files[0].path.suffix != ".jsonl":
            windows = self._spilled_windows(size, lines, spill)
        else:
            windows = (self._window(a, min(a + size, self.shard.stop), lines) for a in self._starts(size))
        for a, (rows, data) in zip(self._starts(size), windows, strict=True):
            if not np.array_equal(rows, np.arange(a, min(a + size, self.shard.stop))):  # a file changed meanwhile
                raise RunDirError(f"shard {self.shard.index}: committed files changed while being read")
            yield rows, data

    def _starts(self, size: int) -> range:
        return range(self.shard.start, self.shard.stop, size)

    def _spilled_windows(self, size: int, lines: bool, spill: Path) -> Iterator[tuple[np.ndarray, pa.Table | bytes]]:
        """Windows of Parquet files, each file read once: its kept rows cut by window into spill
        (one record batch list per window), then each window read back from spill."""
        count = len(self._starts(size))
        batches: list[list[int]] = [[] for _ in range(count)]
        rows: list[list[np.ndarray]] = [[] for _ in range(count)]
        # lz4: the scratch file ~2.5x smaller than plain Arrow at little cost; one thread, as the
        # Parquet reads (compressing in the thread pool cost 10-60 MB of RSS and no time on 2 cores)
        options = pa.ipc.IpcWriteOptions(compression="lz4", use_threads=False)
        with pa.OSFile(str(spill), "wb") as sink, pa.ipc.new_file(sink, self.schema, options=options) as writer:
            n = 0
            for f in self.files:
                kept = np.flatnonzero(f.keep)
                if not len(kept):
                    continue
                table = _read_file(f, self.schema)
                window = (f.rows[kept] - self.shard.start) // size
                # kept positions grouped by window, ascending within each (as _window takes them)
                by_window = np.argsort(window, kind="stable")
                grouped = kept[by_window]
                ws, firsts = np.unique(window[by_window], return_index=True)
                for w, positions in zip(ws.tolist(), np.split(grouped, firsts[1:]), strict=True):
                    rows[w].append(f.rows[positions])
                    for batch in table.take(pa.array(positions)).to_batches():
                        writer.write_batch(batch)
                        batches[w].append(n)
                        n += 1
                del table
        with pa.OSFile(str(spill), "rb") as source:
            reader = pa.ipc.open_file(source, options=pa.ipc.IpcReadOptions(use_threads=False))
            for w in range(count):
                got = np.concatenate(rows[w]) if rows[w] else np.zeros(0, dtype=np.int64)
                order = np.argsort(got, kind="stable")
                table = pa.Table.from_batches([reader.get_batch(i) for i in batches[w]], schema=self.schema)
                table = table.take(pa.array(order))
                rows[w] = []
                yield got[order], (table_to_jsonl(table) if lines else table)

    def _window(self, a: int, b: int, lines: bool) -> tuple[np.ndarray, pa.Table | bytes]:
        got_rows: list[np.ndarray] = []
        tables: list[pa.Table] = []
        texts: list[bytes] = []
        for f in self.files:
            if f.ordered:
                lo, hi = np.searchsorted(f.rows, [a, b])
                positions = np.arange(lo, hi)[f.keep[lo:hi]]
            else:
                positions = np.flatnonzero(f.keep & (f.rows >= a) & (f.rows < b))
            if f.path.suffix == ".jsonl":
                if f.ordered:
                    texts += _read_lines_run(f, int(lo), int(hi))
                else:
                    texts += _read_lines_at(f, positions)
            if not len(positions):
                continue
            got_rows.append(f.rows[positions])
            if f.path.suffix != ".jsonl":
                tables.append(_read_positions(f, positions, self.schema))
        rows = np.concatenate(got_rows) if got_rows else np.zeros(0, dtype=np.int64)
        order = np.argsort(rows, kind="stable")
        if lines:
            if tables:  # Parquet files: their rows as JSON lines
                return rows[order], table_to_jsonl(pa.concat_tables(tables).take(pa.array(order)))
            return rows[order], b"".join(texts[i] + b"\n" for i in order.tolist())
        if texts:
            tables = [jsonl_to_table(b"\n".join(texts), self.schema)]
        table = pa.concat_tables(tables) if tables else self.schema.empty_table()
        return rows[order], table.take(pa.array(order))


def _read_positions(f: FileRows, positions: np.ndarray, schema: pa.Schema) -> pa.Table:
    """Rows at these positions of a Parquet file, reading only the row groups that hold them."""
    starts = f.group_starts
    assert starts is not None
    g0 = int(np.searchsorted(starts, positions[0], side="right")) - 1
    g1 = int(np.searchsorted(starts, positions[-1], side="right")) - 1
    with pq.ParquetFile(f.path) as pf:
        table = pf.read_row_groups(list(range(g0, g1 + 1)), use_threads=False)
    if not table.schema.equals(schema):
        table = table.cast(schema)
    return table.take(pa.array(positions - starts[g0]))


def _read_file(f: FileRows, schema: pa.Schema) -> pa.Table:
    """A Parquet file's rows, whole, in the run's schema."""
    with pq.ParquetFile(f.path) as pf:
        table = pf.read(use_threads=False)
    return table if table.schema.equals(schema) else table.cast(schema)


def _read_lines_run(f: FileRows, lo: int, hi: int) -> list[bytes]:
    """The kept lines at positions lo..hi of a sorted JSONL file, read on from where the last
    window stopped (windows come in row order, so each line is read once)."""
    if hi <= lo:
        return []
    out: list[bytes] = []
    with open(f.path, "rb") as fh:
        fh.seek(f.next_offset)
        pos = f.next_pos
        while pos < hi:
            line = fh.readline()
            if not line:
                raise RunDirError(f"{f.path}: shorter than when its rows were read")
            line = line.rstrip(b"\n")
            if not line.strip():
                continue
            if pos >= lo and f.keep[pos]:
                out.append(line)
            pos += 1
        f.next_pos, f.next_offset = pos, fh.tell()
    return out


def _read_lines_at(f: FileRows, positions: np.ndarray) -> list[bytes]:
    """Lines at these positions of a JSONL file that is not sorted (read whole: one file's memory)."""
    if not len(positions):
        return []
    lines = [line for line in f.path.read_bytes().split(b"\n") if line.strip()]
    return [lines[i] for i in positions.tolist()]


def count_rows(path: Path) -> int:
    """Rows in a compacted file: the Parquet footer's count, or the lines of a JSONL file."""
    if path.suffix == ".jsonl":
        n = 0
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(BLOCK_BYTES), b""):
                n += block.count(b"\n")
        return n
    with pq.ParquetFile(path) as f:
        return int(f.metadata.num_rows)


def covers(shard: Shard, files: list[Path], schema: pa.Schema) -> bool:
    """Whether these files hold every row of the shard's range."""
    if not files:
        return shard.rows == 0
    rows = np.concatenate([row_column(p, schema).rows for p in files])
    rows = np.unique(rows[(rows >= shard.start) & (rows < shard.stop)])
    return len(rows) == shard.rows


def keep_mask_sorted(rows: np.ndarray, previous: int) -> np.ndarray:
    """Copies to keep in a run of rows read in row order: a row equal to the one before it (or to
    `previous`, the last row of the run before) is a later copy and is dropped."""
    before = np.concatenate([[previous], rows[:-1]]) if len(rows) else rows
    return rows != before


def take_lines(data: bytes, keep: np.ndarray) -> bytes:
    """The lines of data whose keep flag is set (data: whole lines, one per flag)."""
    lines = [line for line in data.split(b"\n") if line.strip()]
    return b"".join(line + b"\n" for line, k in zip(lines, keep.tolist(), strict=True) if k)
