"""The run directory on disk: run.yaml, plan, atomic parts, progress, DONE (locks: locks.py)."""

from __future__ import annotations

import errno
import io
import json
import os
import re
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import yaml

from batchinfer import faults
from batchinfer.config.schema import Config, to_config
from batchinfer.errors import RunDirError, StorageError
from batchinfer.inputs.read import Shard
from batchinfer.rundir.schema import jsonl_columns, jsonl_to_table, schema_from_text, table_to_jsonl
from batchinfer.security import redact_config

PART_RE = re.compile(r"^part-(\d{6})\.(parquet|jsonl)$")
# A finished shard's parts compacted into one file sorted by row; DONE.json names it (the rule:
# named -> it holds the shard and leftover parts are ignored; not named -> parts hold the shard and
# a file of this name is a leftover of a killed compaction).
COMPACTED_RE = re.compile(r"^rows\.(parquet|jsonl)$")
# Row groups of a compacted Parquet file: merge streams them, so its memory is one group, not a shard.
ROW_GROUP_ROWS = 65536
TMP_PREFIX = ".tmp-"
OUTPUT_EXT = {"jsonl": "jsonl", "openai": "jsonl", "parquet": "parquet", "hf": "parquet"}


def fsync_dir(path: Path) -> None:
    """Make a rename in path durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# Errors that say the filesystem refuses writes; anything else is a bug and keeps its traceback.
STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}


def refused_write(e: OSError) -> Optional[int]:
    """The errno when e says the filesystem refuses writes (pyarrow puts it only in the text)."""
    if e.errno in STORAGE_ERRNOS:
        return e.errno
    found = re.search(r"\[Errno (\d+)\]", str(e))
    return int(found.group(1)) if found and int(found.group(1)) in STORAGE_ERRNOS else None


def storage_error(path: Path, e: OSError) -> StorageError:
    """A user-facing error for a write the filesystem refused."""
    code = refused_write(e)
    why = {
        errno.ENOSPC: "the disk is full",
        errno.EDQUOT: "the disk quota is exceeded",
        errno.EROFS: "the filesystem is read-only",
        errno.EFBIG: "the file is too large for the filesystem",
    }.get(code or 0, "permission denied")
    return StorageError(
        f"cannot write {path}: {why} ({os.strerror(code or errno.EACCES)}). Nothing already committed was changed; "
        f"free space or fix the permissions of {path.parent}, then run the same command again "
        f"(or `batchinfer resume DIR` for a Slurm run): only the missing rows are redone"
    )


def temporary_name(path: Path) -> Path:
    """A temporary name beside path, unique to this writer, that no reader takes for a part or output."""
    return path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}")


def atomic_write(path: Path, data: bytes, fault_prefix: Optional[str] = None) -> None:
    """Write data under a temporary name, fsync, rename into place, fsync the folder.

    A refused write (disk full, read-only) removes the temporary and raises StorageError."""
    tmp = temporary_name(path)
    try:
        _write_temporary(tmp, data, fault_prefix)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as e:
        raise _write_failed(tmp, path, e) from None
    if fault_prefix:
        faults.point(f"after-{fault_prefix}-rename")


def publish_new(folder: Path, name: Callable[[int], str], first: int, data: bytes, fault_prefix: str) -> Path:
    """Write data as a new file under the first free name(first), name(first + 1), ...: an existing
    file is never replaced (os.link fails on an existing name, where a rename would overwrite it)."""
    tmp = temporary_name(folder / name(first))
    n = first
    try:
        _write_temporary(tmp, data, fault_prefix)
        while not _link_new(tmp, folder / name(n)):
            n += 1
        os.unlink(tmp)
        fsync_dir(folder)
    except OSError as e:
        raise _write_failed(tmp, folder / name(n), e) from None
    faults.point(f"after-{fault_prefix}-rename")
    return folder / name(n)


def create_once(path: Path, data: bytes, fault_prefix: Optional[str] = None) -> bool:
    """Write data as path unless path exists; True if this call created it (first writer wins)."""
    tmp = temporary_name(path)
    try:
        _write_temporary(tmp, data, fault_prefix)
        created = _link_new(tmp, path)
        os.unlink(tmp)
        fsync_dir(path.parent)
    except OSError as e:
        raise _write_failed(tmp, path, e) from None
    if fault_prefix:
        faults.point(f"after-{fault_prefix}-rename")
    return created


def _link_new(tmp: Path, path: Path) -> bool:
    """Give tmp the name path if that name is free; False if another file has it."""
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        # NFS: a retransmitted LINK can answer EEXIST although it succeeded (open(2));
        # then the temporary has two names and these bytes are already published.
        return os.stat(tmp).st_nlink >= 2


def _write_temporary(tmp: Path, data: bytes, fault_prefix: Optional[str]) -> None:
    with open(tmp, "wb") as f:
        if fault_prefix:
            f.write(data[: len(data) // 2])
            f.flush()
            faults.point(f"in-{fault_prefix}-write")
            f.write(data[len(data) // 2 :])
        else:
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if fault_prefix:
        faults.point(f"before-{fault_prefix}-rename")


def _write_failed(tmp: Path, path: Path, e: OSError) -> OSError:
    """The error to raise for a failed write: StorageError when the filesystem refuses writes
    (the temporary removed), else e itself (the temporary is left for the next writer to remove)."""
    if refused_write(e) is None:
        return e
    try:
        tmp.unlink(missing_ok=True)
    except OSError:
        pass  # read-only: the temporary (if any) is removed by the next writer
    return storage_error(path, e)


def write_json(path: Path, obj: Any) -> None:
    """Atomically write a JSON file."""
    atomic_write(path, (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode())


def read_json(path: Path) -> Any:
    """Read a JSON file."""
    return json.loads(path.read_text())


def table_bytes(table: pa.Table, fmt: str, row_group_size: Optional[int] = None) -> bytes:
    """Encode a table as a Parquet or JSONL file's bytes."""
    if fmt == "jsonl":
        return table_to_jsonl(table)
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd", row_group_size=row_group_size)
    return buf.getvalue()


def sorted_jsonl(chunks: list[bytes], schema: pa.Schema, columns: list[str]) -> tuple[bytes, pa.Table]:
    """JSON lines of several files as one text sorted by row, the committed lines kept byte for
    byte, and the given columns of those rows (in the same order)."""
    lines = [line for data in chunks for line in data.split(b"\n") if line.strip()]
    tables = [jsonl_columns(data, schema, columns) for data in chunks]
    table = pa.concat_tables(tables) if tables else pa.schema([schema.field(c) for c in columns]).empty_table()
    order = pc.sort_indices(table, sort_keys=[("row", "ascending")])
    if len(lines) != table.num_rows:
        raise RunDirError(f"{len(lines)} JSON lines parsed as {table.num_rows} rows")
    text = b"".join(lines[i] + b"\n" for i in order.to_numpy())
    return text, table.take(order)


def sorted_parts(parts: list[Path], schema: pa.Schema) -> pa.Table:
    """The rows of several parts as one table sorted by row (the whole shard in memory)."""
    tables = [read_table(p, schema) for p in parts]
    return (pa.concat_tables(tables) if tables else schema.empty_table()).sort_by("row")


def read_table(path: Path, schema: pa.Schema, columns: Optional[list[str]] = None) -> pa.Table:
    """Read one part or output file back in the run's schema."""
    if path.suffix == ".jsonl":
        table = jsonl_to_table(path.read_bytes(), schema)
        return table.select(columns) if columns else table
    return pq.read_table(path, columns=columns, schema=schema if columns is None else None)


class _NoAliasDumper(yaml.SafeDumper):
    """run.yaml is read by people: no &id001 anchors for repeated values."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


class RunDir:
    """Paths and records of one run directory."""

    def __init__(self, path: Path | str):
        self.path = Path(path).expanduser().resolve()
        self.run_yaml = self.path / "run.yaml"
        self.plan_json = self.path / "plan.json"
        self.input_dir = self.path / "input"
        self.shards_dir = self.path / "shards"
        self.logs_dir = self.path / "logs"
        self.stats_json = self.path / "stats.json"
        self._run: Optional[dict[str, Any]] = None
        self._schema: Optional[pa.Schema] = None
        self._config: Optional[Config] = None

    def exists(self) -> bool:
        """Whether run.yaml has been written."""
        return self.run_yaml.is_file()

    @property
    def run(self) -> dict[str, Any]:
        """run.yaml, read once."""
        if self._run is None:
            if not self.exists():
                raise RunDirError(f"{self.path}: not a run directory (no run.yaml)")
            self._run = yaml.safe_load(self.run_yaml.read_text())
        return self._run

    def write_run(self, record: dict[str, Any]) -> None:
        """Write run.yaml atomically; secret cluster.env values are stored as <redacted> (kept in memory)."""
        stored = dict(record, config=redact_config(record["config"])) if "config" in record else record
        text = yaml.dump(stored, Dumper=_NoAliasDumper, sort_keys=False, allow_unicode=True)
        atomic_write(self.run_yaml, text.encode())
        self._run = record
        self._config = None

    @property
    def config(self) -> Config:
        """The run's frozen config, typed (run.yaml's `config`)."""
        if self._config is None:
            self._config = to_config(self.run["config"])
        return self._config

    @property
    def schema(self) -> pa.Schema:
        """The run's output schema."""
        if self._schema is None:
            self._schema = schema_from_text(self.run["output_schema"]["arrow"])
        return self._schema

    @property
    def output_format(self) -> str:
        """jsonl, parquet, openai or hf."""
        return self.config.output.format

    @property
    def part_format(self) -> str:
        """Parts are JSONL for JSONL output, else Parquet."""
        return "jsonl" if self.output_format == "jsonl" else "parquet"

    @property
    def output_split(self) -> Optional[int]:
        """output.max_rows_per_file: the merged output as several files of at most this many rows."""
        return self.config.output.max_rows_per_file

    @property
    def output_path(self) -> Path:
        """Where merge writes the dataset: output.<ext>, or the folder DIR/output (split files, or
        a `save_to_disk` dataset for output.format=hf)."""
        if self.output_format == "hf" or self.output_split:
            return self.path / "output"
        return self.path / f"output.{OUTPUT_EXT[self.output_format]}"

    def shards(self) -> list[Shard]:
        """The shard plan from plan.json."""
        plan = read_json(self.plan_json)
        return [Shard(s["index"], s["start"], s["stop"]) for s in plan["shards"]]

    def shard_dir(self, index: int) -> Path:
        """Folder of one shard's parts and markers."""
        return self.shards_dir / f"{index:05d}"

    def done_path(self, index: int) -> Path:
        """The shard's DONE.json."""
        return self.shard_dir(index) / "DONE.json"

    def progress_path(self, index: int) -> Path:
        """The shard's progress.json."""
        return self.shard_dir(index) / "progress.json"

    def is_done(self, index: int) -> bool:
        """Whether the shard's DONE.json exists."""
        return self.done_path(index).is_file()

    @property
    def compacted_name(self) -> str:
        """The name of a finished shard's compacted file: rows.parquet, or rows.jsonl for JSONL parts."""
        return f"rows.{self.part_format}"

    def done_record(self, index: int) -> Optional[dict[str, Any]]:
        """The shard's DONE.json, or None while it is not finished."""
        try:
            return read_json(self.done_path(index))  # type: ignore[no-any-return]
        except FileNotFoundError:
            return None

    def compacted(self, index: int, done: Optional[dict[str, Any]] = None) -> Optional[Path]:
        """The shard's compacted file when its DONE.json names one (done: that record, if already read)."""
        if done is None:
            done = self.done_record(index)
        name = (done or {}).get("compacted")
        if not name:
            return None
        if not COMPACTED_RE.match(str(name)):  # DONE.json is data: never a path out of the folder
            raise RunDirError(f"{self.done_path(index)}: 'compacted' is {name!r}, not rows.parquet or rows.jsonl")
        return self.shard_dir(index) / name

    def finish_shard(self, index: int, done: dict[str, Any]) -> None:
        """Mark a shard finished (under its lock): compact its parts into one file sorted by row,
        write DONE.json naming it (the commit point), then remove the parts. A kill at any step
        leaves either parts + no DONE (a compacted file is a leftover) or DONE naming a whole file."""
        if self.compacted(index) is not None:  # finished already: its rows live in the compacted file
            self.clean_temporaries(index)
            return
        folder = self.shard_dir(index)
        parts = self.part_files(index)
        target = folder / self.compacted_name
        target.unlink(missing_ok=True)  # a killed compaction's: no DONE.json names it
        if not create_once(target, self._compacted_bytes(parts), "compact"):
            raise RunDirError(f"{target}: written meanwhile by another writer; the shard lock was not held")
        write_json(self.done_path(index), dict(done, compacted=target.name))
        faults.point("after-compact-done")
        for n, p in enumerate(parts):
            p.unlink(missing_ok=True)
            if n == 0:
                faults.point("in-compact-cleanup")
        fsync_dir(folder)

    def _compacted_bytes(self, parts: list[Path]) -> bytes:
        """The rows of parts as one file sorted by row, in the part format."""
        if self.part_format == "jsonl":
            return sorted_jsonl([p.read_bytes() for p in parts], self.schema, ["row"])[0]
        return table_bytes(sorted_parts(parts, self.schema), "parquet", ROW_GROUP_ROWS)

    def part_files(self, index: int) -> list[Path]:
        """The part-NNNNNN files in the shard's folder, in commit order (whatever DONE.json says)."""
        d = self.shard_dir(index)
        if not d.is_dir():
            return []
        return sorted(p for p in d.iterdir() if PART_RE.match(p.name))

    def parts(self, index: int, done: Optional[dict[str, Any]] = None) -> list[Path]:
        """The files holding a shard's committed rows: its compacted file when DONE.json names one,
        else its parts in commit order."""
        compacted = self.compacted(index, done)
        return [compacted] if compacted is not None else self.part_files(index)

    def read_shard(self, index: int, columns: Optional[list[str]] = None) -> pa.Table:
        """All committed rows of a shard (commit order, or row order once compacted)."""
        tables = [read_table(p, self.schema, columns) for p in self.parts(index)]
        if not tables:
            schema = self.schema if columns is None else pa.schema([self.schema.field(c) for c in columns])
            return schema.empty_table()
        return pa.concat_tables(tables)

    def write_part(self, index: int, table: pa.Table) -> Path:
        """Commit rows as the shard's next part: whole or absent."""
        parts = self.part_files(index)
        n = int(PART_RE.match(parts[-1].name).group(1)) + 1 if parts else 0  # type: ignore[union-attr]
        fmt = self.part_format
        return publish_new(self.shard_dir(index), lambda k: f"part-{k:06d}.{fmt}", n, table_bytes(table, fmt), "part")

    def clean_temporaries(self, index: int) -> int:
        """Remove what a killed writer left (call under the shard lock): temporaries, and by the
        compaction rule parts of a shard whose DONE.json names its compacted file, or a compacted
        file that DONE.json does not name. Never follows a symlink."""
        return self.remove_leftovers(index, temporaries=True)

    def remove_leftovers(self, index: int, done: Optional[dict[str, Any]] = None, temporaries: bool = False) -> int:
        """Remove leftovers of a killed compaction (and temporaries if asked); the count removed.

        Safe only where no writer can be mid-compaction: under the shard lock, or in merge (under
        the run lock) for a shard with DONE.json."""
        d = self.shard_dir(index)
        if not d.is_dir():
            return 0
        compacted = self.compacted(index, done)
        removed = 0
        for p in d.iterdir():
            leftover = (
                (temporaries and p.name.startswith(TMP_PREFIX))
                or (compacted is not None and PART_RE.match(p.name) is not None)
                or (compacted is None and COMPACTED_RE.match(p.name) is not None)
            )
            if leftover and p.is_file() and not p.is_symlink():
                p.unlink(missing_ok=True)
                removed += 1
        return removed
