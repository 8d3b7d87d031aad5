"""Reading a corpus referenced in place (DIR/input/reference.json): input rows mapped to (file, row
group), each file checked against the manifest when it is opened, a changed file refused."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa

from batchinfer.errors import InputError
from batchinfer.inputs.file_layout import file_stat, footer_digest, ipc_reader, parquet_footer, parquet_metadata
from batchinfer.inputs.reference import MANIFEST, manifest_ids, manifest_schema

# A row group is decoded in batches of about this many bytes: a shard that needs a few rows of a
# big row group holds one batch, not the whole group.
BATCH_BYTES = 64 << 20
OPEN_FILES = 16


class Rows:
    """Selected rows (what `Dataset.select` gives the callers: `to_list`, `len`)."""

    def __init__(self, table: pa.Table):
        self.table = table

    def __len__(self) -> int:
        return self.table.num_rows

    def to_list(self) -> list[dict[str, Any]]:
        """The rows as dicts, nested fields as dicts."""
        return self.table.to_pylist()


class _Cursor:
    """Where a row group is being read: its batch iterator and the batch at hand."""

    def __init__(self, key: tuple[int, int], batches: Iterator[pa.RecordBatch]):
        self.key = key
        self.batches = batches
        self.start = 0
        self.batch = next(batches)

    def advance(self) -> None:
        self.start += self.batch.num_rows
        self.batch = next(self.batches)


class ReferencedInput:
    """The referenced corpus with the calls the worker, validate and prepare make of a memory-mapped
    `datasets.Dataset`: `len`, `select(rows).to_list()`, `column_names`, `data.schema`,
    `data.column(name)`. Each file is checked against the manifest the first time it is opened."""

    def __init__(self, dest: Path, manifest: dict[str, Any], batch_bytes: int = BATCH_BYTES):
        import numpy as np

        self.dest = dest
        self.manifest = manifest
        self.batch_bytes = batch_bytes
        self.format = manifest["format"]
        self.files = manifest["files"]
        self.schema = manifest_schema(manifest)
        counts = [(f, g, n) for f, rec in enumerate(self.files) for g, n in enumerate(rec["pieces"])]
        self._pieces = [(f, g) for f, g, _ in counts]
        self._starts = np.cumsum([0] + [n for _, _, n in counts])
        # Where each piece (row group, record batch) starts within its file.
        self._within = [int(sum(self.files[f]["pieces"][:g])) for f, g in self._pieces]
        self._open: OrderedDict[int, Any] = OrderedDict()  # the last OPEN_FILES opened, most recent last
        self._cursor: Optional[_Cursor] = None

    @property
    def data(self) -> ReferencedInput:
        """`datasets`' table API: schema and column."""
        return self

    @property
    def column_names(self) -> list[str]:
        """The top-level column names."""
        return self.schema.names

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, row: int) -> dict[str, Any]:
        return self.select([row]).to_list()[0]

    def column(self, name: str) -> pa.ChunkedArray:
        """One whole column, reading that column only."""
        for f in range(len(self.files)):
            self._checked(f)
        return pa.chunked_array(manifest_ids(self.manifest, name), type=self.schema.field(name).type)

    def select(self, rows: Sequence[int]) -> Rows:
        """The rows at these input indices, in this order; only the row groups holding them are read."""
        import numpy as np

        wanted = np.asarray(rows, dtype=np.int64)
        if len(wanted) == 0:
            return Rows(self.schema.empty_table())
        if wanted.min() < 0 or wanted.max() >= len(self):
            raise IndexError(f"row index out of range: the input has {len(self)} rows")
        unique, order = np.unique(wanted, return_inverse=True)
        piece = np.searchsorted(self._starts, unique, side="right") - 1
        parts = []
        for p in np.unique(piece):
            local = unique[piece == p] - self._starts[p]
            parts.append(self._read(int(p), local))
        table = pa.Table.from_batches([b for part in parts for b in part], schema=self.schema)
        return Rows(table.take(pa.array(order)))

    def _read(self, p: int, local: Any) -> list[pa.RecordBatch]:
        """Rows (sorted offsets) of one piece: an Arrow record batch of the memory-mapped file, or
        a Parquet row group read batch by batch from a cursor that goes on where the last read stopped."""
        import numpy as np

        f, g = self._pieces[p]
        source = self._checked(f)
        if self.format != "parquet":
            return source.take(pa.array(local + self._within[p])).to_batches()
        cur = self._cursor
        if cur is None or cur.key != (f, g) or local[0] < cur.start:
            meta = source.metadata.row_group(g)
            size = max(1024, min(meta.num_rows, meta.num_rows * self.batch_bytes // max(1, meta.total_byte_size)))
            cur = self._cursor = _Cursor((f, g), source.iter_batches(batch_size=size, row_groups=[g]))
        out, i = [], 0
        while True:
            end = cur.start + cur.batch.num_rows
            j = int(np.searchsorted(local, end, side="left"))
            if j > i:
                out.append(cur.batch.take(pa.array(local[i:j] - cur.start)))
                i = j
            if i == len(local):
                return out
            cur.advance()

    def _checked(self, f: int) -> Any:
        """File f opened (a ParquetFile, or its memory-mapped Arrow table), checked against the manifest
        each time it is opened."""
        if f in self._open:
            self._open.move_to_end(f)
            return self._open[f]
        import pyarrow.parquet as pq

        rec = self.files[f]
        check_unchanged(rec, self.dest)  # at every opening: one stat, and a Parquet file's footer
        path = str(rec["path"])
        self._open[f] = (
            pq.ParquetFile(path, metadata=checked_footer(rec, self.dest))
            if self.format == "parquet"
            else ipc_reader(pa.memory_map(path)).read_all()
        )
        if len(self._open) > OPEN_FILES:  # thousands of files must not hold thousands of descriptors
            self._open.popitem(last=False)
        return self._open[f]


def check_unchanged(rec: dict[str, Any], dest: Path) -> None:
    """Refuse a referenced file that is gone or whose size or mtime differs from the manifest's."""
    path = Path(rec["path"])
    what = f"{dest / MANIFEST} refers to {path} in place"
    try:
        size, mtime = file_stat(path)
    except OSError as e:
        raise InputError(
            f"{what}, and it cannot be read here ({e.strerror}): restore it (visible from every node "
            f"that runs tasks), or start a new run in another output.dir"
        ) from None
    if (size, mtime) != (rec["size"], rec["mtime_ns"]):
        changes = []
        if size != rec["size"]:
            changes.append(f"size {rec['size']} -> {size} bytes")
        if mtime != rec["mtime_ns"]:
            changes.append(f"mtime_ns {rec['mtime_ns']} -> {mtime}")
        raise InputError(
            f"{what}, and it changed since the run was prepared ({', '.join(changes)}): outputs would not "
            f"match their rows. Restore the file, or start a new run in another output.dir; if only its "
            f"time changed (touch, a copy), `touch -d @{rec['mtime_ns'] // 10**9}.{rec['mtime_ns'] % 10**9:09d} "
            f"{path}` puts it back"
        )


def checked_footer(rec: dict[str, Any], dest: Path) -> Any:
    """A referenced Parquet file's metadata, from one reading of its footer; refused where the footer's
    digest is not the manifest's: a file rewritten, then touched back to its size and mtime."""
    path = Path(rec["path"])
    what = f"{dest / MANIFEST} refers to {path} in place"
    try:
        footer = parquet_footer(path)
    except (OSError, ValueError) as e:
        raise InputError(
            f"{what}, and its Parquet footer cannot be read now ({e}): restore the file as it was "
            f"prepared, or start a new run in another output.dir"
        ) from None
    digest = footer_digest(footer)
    if rec.get("digest", digest) != digest:
        raise InputError(
            f"{what}, and it was rewritten since the run was prepared: its size and mtime are as they were, "
            f"but its Parquet footer (row groups, sizes, statistics) is not (digest {rec['digest']} -> {digest}), "
            f"so outputs would not match their rows. Restore the file as it was prepared, or start a new "
            f"run in another output.dir (touch cannot make a rewritten file the one prepared)"
        )
    return parquet_metadata(footer).metadata


def open_reference(dest: Path) -> ReferencedInput:
    """The referenced corpus of DIR/input."""
    manifest = json.loads((dest / MANIFEST).read_text(encoding="utf-8"))
    return ReferencedInput(dest, manifest)
