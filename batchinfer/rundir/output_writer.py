"""The merged output's files: rows in input order into one file or files of at most
output.max_rows_per_file rows (JSONL, OpenAI Batch lines or Parquet), and the `datasets` folder."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchinfer.durable import fsync_dir
from batchinfer.rundir.ordered_rows import Rows
from batchinfer.rundir.schema import jsonl_to_table, table_to_jsonl
from batchinfer.rundir.store import OUTPUT_EXT, RunDir
from batchinfer.security import remove_path


class OutputWriter:
    """Rows in input order into one file, or into files of at most output.max_rows_per_file rows."""

    def __init__(self, run: RunDir, target: Path, schema: Optional[pa.Schema] = None):
        self.run = run
        self.schema = schema or run.schema  # with a `pass` column when DIR has passes
        self.ext = OUTPUT_EXT[run.output_format]
        self.max_rows = run.output_split
        total = int(sum(s.rows for s in run.shards()))
        self.n_files = max(1, math.ceil(total / self.max_rows)) if self.max_rows else 1
        self.folder = target if self.max_rows or run.output_format == "hf" else None
        if self.folder is not None:
            self.folder.mkdir(parents=True)
        self.target = target
        self.encode = openai_lines(run) if run.output_format == "openai" else table_to_jsonl
        self.files: list[Path] = []
        self._file: Any = None
        self._rows_in_file = 0

    def write(self, rows: Rows) -> None:
        """Append rows, starting a new file whenever the current one is full."""
        if rows.lines is not None and self.ext == "jsonl" and self.encode is table_to_jsonl:
            self._write_lines(rows.lines, rows.table.num_rows)
            return
        table = rows.table if rows.lines is None else jsonl_to_table(rows.lines, self.schema)
        offset = 0
        while offset < table.num_rows:
            if self._file is None or (self.max_rows and self._rows_in_file >= self.max_rows):
                self._next_file()
            room = self.max_rows - self._rows_in_file if self.max_rows else table.num_rows
            chunk = table.slice(offset, min(room, table.num_rows - offset))
            if self.ext == "parquet":
                self._file.write_table(chunk)
            else:
                self._file.write(self.encode(chunk))
            self._rows_in_file += chunk.num_rows
            offset += chunk.num_rows

    def _write_lines(self, data: bytes, n: int) -> None:
        """Append JSON lines as they are, cut between lines where a file is full."""
        ends = np.flatnonzero(np.frombuffer(data, np.uint8) == 10) + 1 if self.max_rows else None
        offset = 0  # lines written of data
        while offset < n:
            if self._file is None or (self.max_rows and self._rows_in_file >= self.max_rows):
                self._next_file()
            if ends is None:
                self._file.write(data)
                taken = n
            else:
                taken = min(self.max_rows - self._rows_in_file, n - offset)
                start = int(ends[offset - 1]) if offset else 0
                self._file.write(data[start : int(ends[offset + taken - 1])])
            self._rows_in_file += taken
            offset += taken

    def close(self) -> list[Path]:
        """Flush and fsync every file (an empty run still gets one file); return them."""
        if self._file is None:
            self._next_file()
        self._close_file()
        if self.folder is not None:
            fsync_dir(self.folder)
        return self.files

    def _next_file(self) -> None:
        self._close_file()
        if self.folder is None:
            path = self.target
        else:
            path = self.folder / f"output-{len(self.files):05d}-of-{self.n_files:05d}.{self.ext}"
        self.files.append(path)
        if self.ext == "parquet":
            self._file = pq.ParquetWriter(path, self.schema, compression="zstd")
        else:
            self._file = open(path, "wb")
        self._rows_in_file = 0

    def _close_file(self) -> None:
        if self._file is None:
            return
        self._file.close()
        with open(self.files[-1], "rb+") as f:
            os.fsync(f.fileno())
        self._file = None


def to_datasets_folder(folder: Path, parquet_files: list[Path]) -> list[Path]:
    """Turn the merged Parquet files into a `datasets` save_to_disk folder, one Arrow shard each."""
    import datasets

    cache = folder.with_name(folder.name + "-cache")
    remove_path(cache)
    try:
        ds = datasets.Dataset.from_parquet([str(f) for f in parquet_files], cache_dir=str(cache))
        staged = folder.with_name(folder.name + "-hf")
        remove_path(staged)
        ds.save_to_disk(str(staged), num_shards=len(parquet_files))
        del ds
    finally:
        remove_path(cache)
    remove_path(folder)
    os.replace(staged, folder)
    for f in folder.iterdir():
        with open(f, "rb+") as fh:
            os.fsync(fh.fileno())
    fsync_dir(folder)
    return sorted(folder.iterdir())


def openai_lines(run: RunDir) -> Callable[[pa.Table], bytes]:
    """Lines of the OpenAI Batch output format for rows (each request's url from DIR/input)."""
    from batchinfer.inputs.convert import open_input
    from batchinfer.inputs.openai_batch import CHAT_URL, response_line

    urls = open_input(run.input_dir).data.column("url") if run.run["input"]["format"] == "openai" else None
    model = run.recorded_config.model.path
    tag = run.run["fingerprint"][:12]
    created = int(time.time())

    def lines(table: pa.Table) -> bytes:
        rows = table.to_pylist()
        row_urls = urls.take(table.column("row")).to_pylist() if urls is not None else [CHAT_URL] * len(rows)
        out = [
            json.dumps(response_line(row, url, model, tag, created), ensure_ascii=False)
            for row, url in zip(rows, row_urls, strict=True)
        ]
        return ("\n".join(out) + "\n").encode()

    return lines
