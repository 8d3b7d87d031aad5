"""Parquet and Arrow corpora referenced in place: DIR/input/reference.json names each file with its
size, mtime and footer digest; reads map input rows to (file, row group) and refuse a changed file."""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import logging
import os
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa

from batchinfer.errors import InputError

log = logging.getLogger("batchinfer")

MANIFEST = "reference.json"
REFERENCED_FORMATS = ("parquet", "arrow", "hf_disk")
# A row group is decoded in batches of about this many bytes: a shard that needs a few rows of a
# big row group holds one batch, not the whole group.
BATCH_BYTES = 64 << 20
ID_BATCH_ROWS = 1 << 18
OPEN_FILES = 16


def data_files(files: list[Path], fmt: str) -> list[Path]:
    """The files holding the rows: the inputs themselves, or a `save_to_disk` folder's Arrow files."""
    if fmt != "hf_disk":
        return files
    state = json.loads((files[0] / "state.json").read_text(encoding="utf-8"))
    return [files[0] / entry["filename"] for entry in state["_data_files"]]


def parquet_footer(path: Path) -> bytes:
    """A Parquet file's serialized FileMetaData (the footer), read from its last bytes only."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        if size < 12:
            raise ValueError(f"{path}: not a Parquet file (too short)")
        f.seek(size - 8)
        tail = f.read(8)
        length = int.from_bytes(tail[:4], "little")
        if tail[4:] not in (b"PAR1", b"PARE") or length > size - 12:
            raise ValueError(f"{path}: not a Parquet file (no Parquet footer)")
        f.seek(size - 8 - length)
        return f.read(length)


def footer_digest(footer: bytes) -> str:
    """The digest of a Parquet footer that reference.json keeps for each file."""
    return hashlib.blake2b(footer, digest_size=16).hexdigest()


def _parquet_metadata(footer: bytes) -> Any:
    """The file as pyarrow reads it (FileMetaData, Arrow schema) from its footer bytes alone: the
    data pages are never opened."""
    import pyarrow.parquet as pq

    blob = b"PAR1" + footer + len(footer).to_bytes(4, "little") + b"PAR1"
    return pq.ParquetFile(pa.BufferReader(blob))


def _ipc_reader(mapped: Any) -> Any:
    """An IPC file reader (random access to batches), else a stream reader."""
    try:
        return pa.ipc.open_file(mapped)
    except pa.ArrowInvalid:
        mapped.seek(0)
        return pa.ipc.open_stream(mapped)


def arrow_layout(path: Path) -> tuple[str, list[int], pa.Schema, bool]:
    """An Arrow IPC file's layout digest (schema, each message's metadata and body length), rows per
    record batch, schema, and whether its buffers are compressed. Memory-mapped: only the message
    headers are touched, never the bodies of uncompressed batches."""
    h = hashlib.blake2b(digest_size=16)
    with pa.memory_map(str(path)) as mapped:
        start = 8 if mapped.read(6) == b"ARROW1" else 0
        mapped.seek(start)
        for message in pa.ipc.MessageReader.open_stream(mapped):
            h.update(message.metadata.to_pybytes())
            h.update((message.body.size if message.body is not None else 0).to_bytes(8, "little"))
        mapped.seek(0)
        reader = _ipc_reader(mapped)
        before = pa.total_allocated_bytes()
        rows, compressed = [], False
        for i, batch in enumerate(_ipc_batches(reader)):
            # A zero-copy batch allocates nothing; a compressed one is decompressed into new memory.
            compressed = compressed or (i == 0 and batch.num_rows > 0 and pa.total_allocated_bytes() > before)
            if compressed:
                break
            rows.append(batch.num_rows)
        return h.hexdigest(), rows, reader.schema, compressed


def _ipc_batches(reader: Any) -> Iterator[pa.RecordBatch]:
    if isinstance(reader, pa.ipc.RecordBatchFileReader):
        return (reader.get_batch(i) for i in range(reader.num_record_batches))
    return iter(reader)


def _stat(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def _schemas_agree(first: pa.Schema, other: pa.Schema) -> bool:
    return first.remove_metadata().equals(other.remove_metadata())


def _datasets_reads_as_is(schema: pa.Schema) -> bool:
    """Whether `datasets` would give these columns the same types and plain Python values (no JSON
    fields it decodes): then rows read here equal the rows of a converted copy."""
    import datasets

    try:
        features = datasets.Features.from_arrow_schema(schema)
        same = features.arrow_schema.remove_metadata().equals(schema.remove_metadata())
    except Exception:  # a type `datasets` cannot hold: the conversion decides, in its own words
        return False
    try:
        from datasets.utils.json import get_json_field_paths_from_feature

        same = same and not list(get_json_field_paths_from_feature(features))
    except ImportError:  # older `datasets`: no JSON fields
        pass
    return same


def plan_reference(files: list[Path], fmt: str) -> Optional[dict[str, Any]]:
    """The manifest of a corpus read in place (footers and headers only), or None where it must be
    converted: files whose schemas differ, types `datasets` would change, compressed Arrow."""
    if fmt not in REFERENCED_FORMATS:
        return None
    try:
        # prepare fingerprints the input, then converts it: the footers are read once, for files
        # whose names, sizes and mtimes are still those of the first reading
        key = (fmt, tuple((str(f), *_stat(f)) for f in data_files(files, fmt)))
        if key not in _PLANS:
            _PLANS.clear()  # one corpus per process is what is asked for
            _PLANS[key] = _plan(files, fmt)
        plan = _PLANS[key]
        return copy.deepcopy(plan) if plan is not None else None
    except (pa.ArrowException, OSError, ValueError, KeyError):
        return None  # not what its suffix says, unreadable: converting reports why, in the reader's words


_PLANS: dict[tuple[Any, ...], Optional[dict[str, Any]]] = {}


def _plan(files: list[Path], fmt: str) -> Optional[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    schema: Optional[pa.Schema] = None
    for path in data_files(files, fmt):
        size, mtime = _stat(path)
        if fmt == "parquet":
            footer = parquet_footer(path)
            parsed = _parquet_metadata(footer)
            meta = parsed.metadata
            digest = footer_digest(footer)
            pieces = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
            file_schema = parsed.schema_arrow
        else:
            digest, pieces, file_schema, compressed = arrow_layout(path)
            if compressed:
                log.info("%s: compressed Arrow: converted once into the run directory", path)
                return None
        if schema is None:
            schema = file_schema
        elif not _schemas_agree(schema, file_schema):
            log.info("%s: its schema differs from %s's: the files are converted", path, records[0]["path"])
            return None
        records.append(
            {
                "path": str(path),
                "size": size,
                "mtime_ns": mtime,
                "digest": digest,
                "rows": sum(pieces),
                "pieces": pieces,
            }
        )
    if schema is None or not _datasets_reads_as_is(schema):
        return None
    return {
        "version": 1,
        "format": "parquet" if fmt == "parquet" else "arrow",
        "rows": sum(r["rows"] for r in records),
        "schema": base64.b64encode(schema.serialize().to_pybytes()).decode(),
        "files": records,
    }


def reference_fingerprint(manifest: dict[str, Any], files: list[Path]) -> str:
    """The corpus identity: each data file's name, size and footer (or IPC layout) digest, and the
    bytes of a saved dataset's small JSON files; not paths or mtimes, so a move or a `touch` keeps it."""
    h = hashlib.blake2b(digest_size=16)
    h.update(b"reference-v1")
    for rec in manifest["files"]:
        h.update(json.dumps([Path(rec["path"]).name, rec["size"], rec["digest"]]).encode())
    for folder in (f for f in files if f.is_dir()):
        for name in ("state.json", "dataset_info.json"):
            h.update(name.encode())
            h.update((folder / name).read_bytes())
    return h.hexdigest()


def manifest_schema(manifest: dict[str, Any]) -> pa.Schema:
    """The corpus' Arrow schema, as the manifest holds it."""
    return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(manifest["schema"])))


def write_manifest(manifest: dict[str, Any], dest: Path) -> None:
    """DIR/input as a folder holding only the manifest."""
    dest.mkdir(parents=True)
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")


def is_reference(dest: Path) -> bool:
    """Whether DIR/input refers to a corpus in place (rather than holding a converted copy)."""
    return (dest / MANIFEST).is_file()


def manifest_ids(manifest: dict[str, Any], column: str) -> Iterable[pa.Array]:
    """The id column, batch by batch, reading that column only."""
    for rec in manifest["files"]:
        yield from _file_column(manifest["format"], Path(rec["path"]), column)


def _file_column(fmt: str, path: Path, column: str) -> Iterator[pa.Array]:
    import pyarrow.parquet as pq

    if fmt == "parquet":
        with pq.ParquetFile(str(path)) as pf:
            for batch in pf.iter_batches(batch_size=ID_BATCH_ROWS, columns=[column]):
                yield batch.column(0)
    else:
        with pa.memory_map(str(path)) as mapped:
            for batch in _ipc_batches(_ipc_reader(mapped)):
                yield batch.column(column)


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
            else _ipc_reader(pa.memory_map(path)).read_all()
        )
        if len(self._open) > OPEN_FILES:  # thousands of files must not hold thousands of descriptors
            self._open.popitem(last=False)
        return self._open[f]


def check_unchanged(rec: dict[str, Any], dest: Path) -> None:
    """Refuse a referenced file that is gone or whose size or mtime differs from the manifest's."""
    path = Path(rec["path"])
    what = f"{dest / MANIFEST} refers to {path} in place"
    try:
        size, mtime = _stat(path)
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
    return _parquet_metadata(footer).metadata


def open_reference(dest: Path) -> ReferencedInput:
    """The referenced corpus of DIR/input."""
    manifest = json.loads((dest / MANIFEST).read_text(encoding="utf-8"))
    return ReferencedInput(dest, manifest)
