"""Some columns of a run's committed rows, read from each shard's committed files (the compacted file
of a finished shard, else its parts), Parquet or JSON lines alike."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchinfer.rundir.schema import jsonl_columns
from batchinfer.rundir.store import RunDir


def read_committed(run: RunDir, path: Path, columns: Sequence[str]) -> pa.Table:
    """COLUMNS of one committed file of RUN."""
    if path.suffix == ".jsonl":
        return jsonl_columns(path.read_bytes(), run.schema, list(columns))
    return pq.read_table(path, columns=list(columns))


def committed_columns(run: RunDir, columns: Sequence[str]) -> pa.Table:
    """COLUMNS of every committed row of RUN (each row is committed once), typed by the run's schema."""
    tables = [
        read_committed(run, path, columns)
        for shard in run.shards()
        for path in run.shard_folder(shard.index).committed_files()
    ]
    schema = pa.schema([run.schema.field(c) for c in columns])
    return pa.concat_tables([t.cast(schema) for t in tables]) if tables else schema.empty_table()
