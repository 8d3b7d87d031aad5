"""Verify every shard is complete and write the output in input order, each row exactly once."""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchinfer import faults
from batchinfer.errors import RunDirError
from batchinfer.inputs.read import Shard
from batchinfer.rundir.locks import RunLock
from batchinfer.rundir.schema import table_to_jsonl
from batchinfer.rundir.store import (
    OUTPUT_EXT,
    TMP_PREFIX,
    RunDir,
    fsync_dir,
    read_json,
    refused_write,
    storage_error,
    write_json,
)
from batchinfer.security import private_umask, remove_path

log = logging.getLogger("batchinfer")


def format_indices(indices: list[int], limit: int = 20) -> str:
    """Short readable list of shard indices."""
    shown = ", ".join(str(i) for i in indices[:limit])
    return shown + (f", ... ({len(indices)} in all)" if len(indices) > limit else "")


def incomplete_shards(run: RunDir) -> list[int]:
    """Shards without DONE.json."""
    return [s.index for s in run.shards() if not run.is_done(s.index)]


def shard_rows_in_order(run: RunDir, shard: Shard) -> pa.Table:
    """A shard's committed rows sorted by row, checked to be exactly its range."""
    table = run.read_shard(shard.index)
    table = table.take(pc.sort_indices(table, sort_keys=[("row", "ascending")]))
    rows = table.column("row").to_numpy()
    if len(rows) != shard.rows or (
        len(rows) and (rows[0] != shard.start or rows[-1] != shard.stop - 1 or (rows[1:] - rows[:-1] != 1).any())
    ):
        seen = Counter(rows.tolist())
        dup = sorted(r for r, n in seen.items() if n > 1)[:5]
        missing = sorted(set(range(shard.start, shard.stop)) - set(seen))[:5]
        raise RunDirError(
            f"shard {shard.index}: committed rows do not match rows {shard.start}..{shard.stop - 1} "
            f"(duplicates {dup}, missing {missing}); the shard folder was changed by hand or by two writers"
        )
    return table


def merge(run: RunDir) -> dict[str, Any]:
    """Write DIR/output* and DIR/stats.json; refuses, naming them, while shards are incomplete."""
    output = run.config.output
    with private_umask(output.private):
        # One merge at a time (a merge job and a `batchinfer merge` typed meanwhile): the second
        # is refused naming the first, instead of renaming the other's half-written file.
        with RunLock(run.path, log=log.warning, mode=output.lock):
            _remove_leftovers(run)
            return _merge(run)


def _remove_leftovers(run: RunDir) -> None:
    """Under the merge lock: what killed merges left (temporary outputs, `-cache`/`-hf` staging)."""
    name = run.output_path.name
    for p in run.path.iterdir():
        if p.name.startswith(TMP_PREFIX) and p.name.endswith((name, f"{name}-cache", f"{name}-hf")):
            remove_path(p)


def _merge(run: RunDir) -> dict[str, Any]:
    missing = incomplete_shards(run)
    if missing:
        raise RunDirError(
            f"{run.path}: {len(missing)} of {len(run.shards())} shards are incomplete "
            f"(shards {format_indices(missing)}); finish them with `batchinfer resume {run.path}` "
            f"or by running the same `batchinfer run` again, then merge"
        )
    t0 = time.monotonic()
    out = run.output_path
    # A name of this merge's own: a merge that did not hold the lock (an older version) cannot
    # rename our half-written file into place, nor we its.
    tmp = out.with_name(f"{TMP_PREFIX}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}-{out.name}")
    stats: dict[str, Any] = {
        "rows": 0,
        "errors": Counter(),
        "finish_reasons": Counter(),
        "prompt_tokens": 0,
        "output_tokens": 0,
    }
    seconds: Counter[str] = Counter()
    shards = run.shards()
    try:
        writer = OutputWriter(run, tmp)
        for n, shard in enumerate(shards):
            table = shard_rows_in_order(run, shard)
            writer.write(table)
            _accumulate(stats, table)
            seconds.update(read_json(run.done_path(shard.index)).get("seconds", {}))
            if n == len(shards) // 2:
                faults.point("in-merge")
        files = writer.close()
        if run.output_format == "hf":
            files = _save_to_disk(tmp, files)
        _replace(tmp, out)
    except OSError as e:
        if refused_write(e) is None:
            raise
        try:
            remove_path(tmp)
        except OSError:
            pass
        raise storage_error(out, e) from None
    stats.update(
        shards=len(shards),
        output=out.name,
        files=[str(f.relative_to(tmp)) for f in files] if out.name == "output" else [out.name],
        errors=dict(stats["errors"]),
        finish_reasons=dict(stats["finish_reasons"]),
        seconds=dict(seconds),
        merge_seconds=round(time.monotonic() - t0, 3),
        fingerprint=run.run["fingerprint"],
    )
    write_json(run.stats_json, stats)
    log.info("merged %d rows from %d shards into %s", stats["rows"], len(shards), out)
    return stats


class OutputWriter:
    """Rows in input order into one file, or into files of at most output.max_rows_per_file rows."""

    def __init__(self, run: RunDir, target: Path):
        self.run = run
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

    def write(self, table: pa.Table) -> None:
        """Append rows, starting a new file whenever the current one is full."""
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
            self._file = pq.ParquetWriter(path, self.run.schema, compression="zstd")
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


def _save_to_disk(folder: Path, parquet_files: list[Path]) -> list[Path]:
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


def _replace(tmp: Path, out: Path) -> None:
    """Put the finished output in place: a file atomically, a folder by swapping names."""
    if tmp.is_dir() and out.exists():
        old = tmp.with_name(tmp.name[: -len(out.name)] + "old-" + out.name)
        remove_path(old)
        os.replace(out, old)
        os.replace(tmp, out)
        remove_path(old)
    else:
        os.replace(tmp, out)
    fsync_dir(out.parent)


def openai_lines(run: RunDir) -> Callable[[pa.Table], bytes]:
    """Lines of the OpenAI Batch output format for rows (each request's url from DIR/input)."""
    from batchinfer.inputs.openai_batch import CHAT_URL, response_line
    from batchinfer.inputs.read import open_input

    urls = open_input(run.input_dir).data.column("url") if run.run["input"]["format"] == "openai" else None
    model = run.config.model.path
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


def _accumulate(stats: dict[str, Any], table: pa.Table) -> None:
    stats["rows"] += table.num_rows
    stats["prompt_tokens"] += int(pc.sum(table.column("prompt_tokens")).as_py() or 0)
    stats["output_tokens"] += int(pc.sum(table.column("output_tokens")).as_py() or 0)
    stats["errors"].update(e["kind"] for e in table.column("error").to_pylist() if e)
    stats["finish_reasons"].update(r for r in table.column("finish_reason").to_pylist() if r)
