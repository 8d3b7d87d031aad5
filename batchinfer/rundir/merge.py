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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchinfer import faults
from batchinfer.errors import RunDirError
from batchinfer.inputs.shards import Shard
from batchinfer.rundir.durable import TMP_PREFIX, fsync_dir, read_json, refused_write, storage_error, write_json
from batchinfer.rundir.locks import RunLock
from batchinfer.rundir.schema import jsonl_columns, jsonl_to_table, table_to_jsonl
from batchinfer.rundir.shardrows import ShardRows, keep_mask_sorted, line_blocks, take_lines
from batchinfer.rundir.store import OUTPUT_EXT, UNREAD, RunDir
from batchinfer.rundir.tables import group_rows
from batchinfer.security import private_umask, remove_path

log = logging.getLogger("batchinfer")


def format_indices(indices: list[int], limit: int = 20) -> str:
    """Short readable list of shard indices."""
    shown = ", ".join(str(i) for i in indices[:limit])
    return shown + (f", ... ({len(indices)} in all)" if len(indices) > limit else "")


def incomplete_shards(run: RunDir) -> list[int]:
    """Shards without DONE.json."""
    return [s.index for s in run.shards() if not run.is_done(s.index)]


# JSON lines of a compacted shard are copied to a JSONL output in blocks of about this size.
READ_BLOCK_BYTES = 8 << 20


@dataclass
class Rows:
    """Some rows of a shard in input order: a table of them or, when `lines` is set, the committed
    JSON lines themselves with a table of only the columns stats read (row included)."""

    table: pa.Table
    lines: Optional[bytes] = None


def stat_columns(run: RunDir) -> list[str]:
    """The columns merge's stats read (and `row`, for the order check)."""
    wanted = ("row", "prompt_tokens", "output_tokens", "error", "finish_reason")
    return [c for c in wanted if c in run.schema.names]


def shard_rows_in_order(run: RunDir, shard: Shard, done: Any = UNREAD) -> Iterator[Rows]:
    """A shard's committed rows in row order, each once, streamed, checked as they come to be exactly
    its range: a later copy of a row is dropped as sealing drops it (the first copy kept, logged),
    a missing row refuses the merge. done: the shard's DONE.json as already read.

    A compacted shard is read a row group (or a block of lines) at a time; a shard still in parts
    (run directories of earlier versions) is merged from its parts a window at a time."""
    if done is UNREAD:
        done = run.done_record(shard.index)
    compacted = run.compacted(shard.index, done)
    lines = run.output_format == "jsonl"
    if compacted is None:
        yield from _parts_in_order(run, shard, run.parts(shard.index, done), lines)
        return
    if not compacted.is_file():
        run.check_compacted(shard.index, compacted)  # raises, naming the file and what to do
    pieces = _jsonl_blocks(run, compacted, lines) if compacted.suffix == ".jsonl" else _row_groups(run, compacted)
    expected = shard.start
    dropped = 0
    for piece in pieces:
        rows = piece.table.column("row").to_numpy()
        keep = keep_mask_sorted(rows, expected - 1)
        if not keep.all():  # sealed by an earlier version with a row twice
            dropped += int((~keep).sum())
            rows = rows[keep]
            mask = pa.array(keep)
            piece = Rows(piece.table.filter(mask), take_lines(piece.lines, keep) if piece.lines is not None else None)
        n = len(rows)
        if n and (rows[0] != expected or expected + n > shard.stop or (n > 1 and (np.diff(rows) != 1).any())):
            _rows_mismatch(run, shard, [compacted])
        expected += n
        if n:
            yield piece
    if expected != shard.stop:
        _rows_mismatch(run, shard, [compacted])
    if dropped:
        log.warning(
            "shard %d: %s holds %d extra copies of rows; each row is merged once (its first copy)",
            shard.index,
            compacted,
            dropped,
        )


def _rows_mismatch(run: RunDir, shard: Shard, files: list[Path]) -> None:
    """Raise, naming what is wrong with the shard's rows (read again: this is the error path)."""
    problem = ShardRows(shard, files, run.schema).check.problem() or "rows out of order"
    raise RunDirError(
        f"shard {shard.index}: committed rows do not match rows {shard.start}..{shard.stop - 1} "
        f"({problem}); the shard folder was changed by hand or by two writers"
    )


def _parts_in_order(run: RunDir, shard: Shard, parts: list[Path], lines: bool) -> Iterator[Rows]:
    """A shard in parts, merged in row order a window at a time, each row once (JSONL to JSONL: the
    lines as committed)."""
    rows = ShardRows(shard, parts, run.schema)
    if not rows.check.complete:
        _rows_mismatch(run, shard, parts)
    if rows.check.dropped:
        log.warning("shard %d: %s; each row is merged once (its first copy)", shard.index, rows.check.duplicates_text())
    columns = stat_columns(run)
    for _, data in rows.windows(group_rows(rows.row_bytes), lines=lines):
        if isinstance(data, bytes):
            yield Rows(jsonl_columns(data, run.schema, columns), data)
        else:
            yield Rows(data)


def _row_groups(run: RunDir, path: Path) -> Iterator[Rows]:
    """A compacted Parquet file, one row group at a time."""
    with pq.ParquetFile(path) as f:
        for i in range(f.num_row_groups):
            table = f.read_row_group(i)
            yield Rows(table if table.schema.equals(run.schema) else table.cast(run.schema))


def _jsonl_blocks(run: RunDir, path: Path, lines: bool) -> Iterator[Rows]:
    """A compacted JSONL file in blocks of whole lines: the lines themselves for a JSONL output."""
    columns = stat_columns(run)
    for data in line_blocks(path, READ_BLOCK_BYTES):
        yield Rows(jsonl_columns(data, run.schema, columns), data) if lines else Rows(jsonl_to_table(data, run.schema))


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


# The output a merge is putting in place (its name and files), until stats.json records it.
MERGING = ".merging.json"


def check_own_output(run: RunDir, out: Path) -> None:
    """RunDirError unless out is absent or what a merge of this run wrote: stats.json (or the record
    of a merge killed before writing it) names it, and a folder holds only the files it names."""
    if not out.exists() and not out.is_symlink():
        return
    for record in (run.stats_json, run.path / MERGING):
        rec = read_json(record) if record.is_file() else {}
        if rec.get("output") != out.name:
            continue
        if not out.is_dir() or out.is_symlink():
            return
        extra = sorted({str(p.relative_to(out)) for p in out.rglob("*") if not p.is_dir()} - set(rec["files"]))
        if not extra:
            return
        raise RunDirError(
            f"{out} holds files no merge of this run wrote ({', '.join(extra[:5])}); merge replaces the "
            f"whole folder, so move them away, then merge again"
        )
    raise RunDirError(
        f"{out} was not written by a merge of this run ({run.stats_json.name} does not name it); merge "
        f"would replace it, so move it away, then merge again"
    )


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
    check_own_output(run, out)
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
            done = read_json(run.done_path(shard.index))
            # under the run lock, DONE.json written: no writer is compacting this shard any more
            run.remove_leftovers(shard.index, done)
            for rows in shard_rows_in_order(run, shard, done):
                writer.write(rows)
                _accumulate(stats, rows.table)
            seconds.update(done.get("seconds", {}))
            if n == len(shards) // 2:
                faults.point("in-merge")
        files = writer.close()
        if run.output_format == "hf":
            files = _save_to_disk(tmp, files)
        faults.point("before-merge-rename")
        # What this merge puts in place, on record before it is there: a merge killed between the
        # rename and stats.json leaves this, and the next one knows the output is its own.
        names = [str(f.relative_to(tmp)) for f in files] if out.name == "output" else [out.name]
        write_json(run.path / MERGING, {"output": out.name, "files": names})
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
        files=names,
        errors=dict(stats["errors"]),
        finish_reasons=dict(stats["finish_reasons"]),
        seconds=dict(seconds),
        merge_seconds=round(time.monotonic() - t0, 3),
        fingerprint=run.run["fingerprint"],
    )
    write_json(run.stats_json, stats)
    (run.path / MERGING).unlink()
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

    def write(self, rows: Rows) -> None:
        """Append rows, starting a new file whenever the current one is full."""
        if rows.lines is not None and self.ext == "jsonl" and self.encode is table_to_jsonl:
            self._write_lines(rows.lines, rows.table.num_rows)
            return
        table = rows.table if rows.lines is None else jsonl_to_table(rows.lines, self.run.schema)
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
        faults.point("in-merge-swap")
        os.replace(tmp, out)
        remove_path(old)
    else:
        os.replace(tmp, out)
    fsync_dir(out.parent)


def openai_lines(run: RunDir) -> Callable[[pa.Table], bytes]:
    """Lines of the OpenAI Batch output format for rows (each request's url from DIR/input)."""
    from batchinfer.inputs.convert import open_input
    from batchinfer.inputs.openai_batch import CHAT_URL, response_line

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
    """Add rows' counts to stats, column-wise (no Python object per row)."""
    stats["rows"] += table.num_rows
    for name in ("prompt_tokens", "output_tokens"):
        if name in table.column_names:
            stats[name] += int(pc.sum(table.column(name)).as_py() or 0)
    if "error" in table.column_names:
        _count(stats["errors"], pc.struct_field(table.column("error"), "kind"))
    if "finish_reason" in table.column_names:
        _count(stats["finish_reasons"], table.column("finish_reason"))


def _count(counter: Counter[str], values: pa.ChunkedArray) -> None:
    for item in pc.value_counts(values).to_pylist():
        if item["values"]:  # nulls (no error, no finish reason) and empty strings are not counted
            counter[item["values"]] += item["counts"]
