"""What identifies a Parquet or Arrow file without reading its data: a Parquet footer and its
digest, an Arrow IPC file's layout digest; and the readers of its batches."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa


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


def parquet_metadata(footer: bytes) -> Any:
    """The file as pyarrow reads it (FileMetaData, Arrow schema) from its footer bytes alone: the
    data pages are never opened."""
    import pyarrow.parquet as pq

    blob = b"PAR1" + footer + len(footer).to_bytes(4, "little") + b"PAR1"
    return pq.ParquetFile(pa.BufferReader(blob))


def ipc_reader(mapped: Any) -> Any:
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
        reader = ipc_reader(mapped)
        before = pa.total_allocated_bytes()
        rows, compressed = [], False
        for i, batch in enumerate(ipc_batches(reader)):
            # A zero-copy batch allocates nothing; a compressed one is decompressed into new memory.
            compressed = compressed or (i == 0 and batch.num_rows > 0 and pa.total_allocated_bytes() > before)
            if compressed:
                break
            rows.append(batch.num_rows)
        return h.hexdigest(), rows, reader.schema, compressed


def ipc_batches(reader: Any) -> Iterator[pa.RecordBatch]:
    """The record batches of an IPC file or stream reader, in order."""
    if isinstance(reader, pa.ipc.RecordBatchFileReader):
        return (reader.get_batch(i) for i in range(reader.num_record_batches))
    return iter(reader)


def file_stat(path: Path) -> tuple[int, int]:
    """(size in bytes, mtime in nanoseconds) of a file."""
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns
