"""The run directory on disk: run.yaml, plan, atomic parts, progress, DONE (locks: locks.py)."""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import re
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, Optional

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from batchinfer import faults
from batchinfer.config.schema import Config, to_config
from batchinfer.errors import RunDirError, StorageError
from batchinfer.inputs.read import Shard
from batchinfer.rundir.schema import jsonl_to_table, schema_from_text, table_to_jsonl
from batchinfer.rundir.shardrows import ShardRows, count_rows, covers
from batchinfer.security import redact_config

log = logging.getLogger("batchinfer")

PART_RE = re.compile(r"^part-(\d{6})\.(parquet|jsonl)$")
# A finished shard's parts compacted into one file sorted by row; DONE.json names it (the rule:
# named -> it holds the shard and leftover parts are ignored; not named -> parts hold the shard and
# a file of this name is a leftover of a killed compaction).
COMPACTED_RE = re.compile(r"^rows\.(parquet|jsonl)$")
# Row groups of a compacted Parquet file: compaction writes one at a time and merge streams them,
# so the memory of either is one group, not a shard. At most this many rows, and about
# GROUP_BYTES of rows (long outputs: fewer rows), never fewer than MIN_GROUP_ROWS.
ROW_GROUP_ROWS = 65536
GROUP_BYTES = 32 << 20
MIN_GROUP_ROWS = 1024
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
        _unlink_temporary(tmp)
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
        _unlink_temporary(tmp)
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
        # NFS: a retransmitted LINK can answer EEXIST although it succeeded (open(2)); then the
        # name is our file and these bytes are already published. Judged by the file the name
        # leads to, not by st_nlink, which a stale attribute cache can still show as 1 (and the
        # same bytes would be published again under the next name).
        return _same_file(tmp, path)


def _same_file(a: Path, b: Path) -> bool:
    """Whether two names lead to one file."""
    sa, sb = os.stat(a), os.stat(b)
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def _unlink_temporary(tmp: Path) -> None:
    """Drop the temporary name of a published file. NFS: a retransmitted REMOVE answers ENOENT
    although the first one removed it; the file is published either way."""
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass


def publish_stream(
    path: Path, fill: Callable[[BinaryIO], None], fault_prefix: str, replace: Optional[Path] = None
) -> bool:
    """Write a file by fill(file) under a temporary name, fsync, then give it the name path: as a
    new name (False if path exists: first writer wins), or over `replace` (== path) when the new
    file holds everything the old one did. The temporary is removed on a refused write."""
    tmp = temporary_name(path)
    try:
        with open(tmp, "wb") as f:
            fill(_FaultingFile(f, fault_prefix))
            f.flush()
            os.fsync(f.fileno())
        faults.point(f"before-{fault_prefix}-rename")
        if replace is not None:
            os.replace(tmp, path)
            created = True
        else:
            created = _link_new(tmp, path)
            _unlink_temporary(tmp)
        fsync_dir(path.parent)
    except OSError as e:
        raise _write_failed(tmp, path, e) from None
    faults.point(f"after-{fault_prefix}-rename")
    return created


class _FaultingFile:
    """A file whose first write stops half way at the fault point in-<prefix>-write (tests)."""

    def __init__(self, f: BinaryIO, prefix: str):
        self.f = f
        self.prefix = prefix
        self.first = True

    def write(self, data: bytes) -> int:
        if self.first and len(data) > 1:
            self.first = False
            self.f.write(data[: len(data) // 2])
            self.f.flush()
            faults.point(f"in-{self.prefix}-write")
            self.f.write(data[len(data) // 2 :])
            return len(data)
        return self.f.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.f, name)


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


def read_table(path: Path, schema: pa.Schema, columns: Optional[list[str]] = None) -> pa.Table:
    """Read one part or output file back in the run's schema."""
    if path.suffix == ".jsonl":
        table = jsonl_to_table(path.read_bytes(), schema)
        return table.select(columns) if columns else table
    return pq.read_table(path, columns=columns, schema=schema if columns is None else None)


def group_rows(row_bytes: float) -> int:
    """Rows of a compacted row group (and of a compaction or merge window) for rows of this size."""
    return min(ROW_GROUP_ROWS, max(MIN_GROUP_ROWS, int(GROUP_BYTES // max(row_bytes, 1.0))))


class _Unread:
    """The default of a `done` argument: the caller has not read DONE.json (None means: it has none)."""


UNREAD: Any = _Unread()


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

    def compacted(self, index: int, done: Any = UNREAD) -> Optional[Path]:
        """The shard's compacted file when its DONE.json names one (done: that record as already
        read, None for no DONE.json; read here when not given)."""
        if done is UNREAD:
            done = self.done_record(index)
        name = (done or {}).get("compacted")
        if not name:
            return None
        if not COMPACTED_RE.match(str(name)):  # DONE.json is data: never a path out of the folder
            raise RunDirError(f"{self.done_path(index)}: 'compacted' is {name!r}, not rows.parquet or rows.jsonl")
        return self.shard_dir(index) / name

    def shard(self, index: int) -> Shard:
        """One shard of the plan."""
        for s in self.shards():
            if s.index == index:
                return s
        raise RunDirError(f"{self.plan_json}: no shard {index}")

    def finish_shard(self, index: int, done: dict[str, Any]) -> dict[str, Any]:
        """Seal a shard (under its lock) when its committed rows are exactly its range: merge its files
        into one file sorted by row (a window at a time), check its row count, write DONE.json naming
        it (the commit point), then remove the parts; returns the DONE record. A later copy of a row
        is dropped (the first committed copy is kept, and logged); missing rows or rows outside the
        range raise RunDirError and nothing is sealed. A kill at any step leaves either the
        committed files + no DONE (a compacted file then is a leftover copy of the parts) or DONE
        naming a whole file."""
        sealed = self.done_record(index)  # read once: a second read could disagree (NFS)
        if self.compacted(index, sealed) is not None:  # finished already: its rows live in the compacted file
            self.remove_leftovers(index, sealed, temporaries=True)
            return sealed  # type: ignore[return-value]
        shard = self.shard(index)
        folder = self.shard_dir(index)
        target = folder / self.compacted_name
        sources = self.parts(index, sealed)
        rows = ShardRows(shard, sources, self.schema)
        if not rows.check.complete:
            raise RunDirError(
                f"shard {index} not sealed: its committed rows are not rows {shard.start}..{shard.stop - 1} "
                f"({rows.check.problem()}); {folder} is left as it is: `batchinfer resume` redoes missing rows, "
                f"a file holding another shard's rows must be moved away by hand"
            )
        if rows.check.dropped:
            log.warning(
                "shard %d: %s were committed (two writers, or a part published twice); keeping each row's "
                "first committed copy",
                index,
                rows.check.duplicates_text(),
            )
        adopted = target in sources  # rows.* no DONE.json names, holding rows no part holds
        if not (adopted and rows.in_order):
            # Over a killed compaction's copy (the parts hold every row) or the adopted file, by an
            # atomic rename: the name never goes missing, even for a writer that lost its lock.
            fill = self._compacted_writer(rows)
            replace = target if adopted or target.exists() else None
            if not publish_stream(target, fill, "compact", replace=replace):
                raise RunDirError(f"{target}: written meanwhile by another writer; the shard lock was not held")
        written = count_rows(target) if target.is_file() else None
        if written != shard.rows:
            what = "is gone (removed meanwhile by another writer)" if written is None else f"holds {written} rows"
            raise RunDirError(f"{target}: {what}, shard {index} has {shard.rows}; not sealed")
        record = dict(done, compacted=target.name)
        if rows.check.dropped:
            record["duplicates_dropped"] = rows.check.dropped
        write_json(self.done_path(index), record)
        faults.point("after-compact-done")
        # The parts go only while the file DONE.json names still holds every row: a second writer
        # (an earlier incarnation on a failing node) may have removed it as a leftover meanwhile.
        self.check_compacted(index, target)
        for n, p in enumerate(q for q in sources if q != target):
            p.unlink(missing_ok=True)
            if n == 0:
                faults.point("in-compact-cleanup")
        fsync_dir(folder)
        return record

    def _compacted_writer(self, rows: ShardRows) -> Callable[[BinaryIO], None]:
        """What writes a shard's rows as one file sorted by row, in the part format, a window at a time."""

        size = group_rows(rows.row_bytes)

        def fill(f: BinaryIO) -> None:
            if self.part_format == "jsonl":
                for _, data in rows.windows(size, lines=True):
                    f.write(data)  # type: ignore[arg-type]
                return
            # Over several windows, each part is read once through a scratch file beside the parts
            # (a temporary: a killed compaction's is removed with the others); a shard of one
            # window (the default 10,000 rows) reads each part once anyway and needs none.
            several = rows.shard.stop - rows.shard.start > size
            spill = temporary_name(rows.files[0].path.with_name("compact.arrow")) if rows.files and several else None
            try:
                with pq.ParquetWriter(f, self.schema, compression="zstd") as writer:
                    for _, table in rows.windows(size, lines=False, spill=spill):
                        writer.write_table(table, row_group_size=size)  # type: ignore[arg-type]
            finally:
                if spill is not None:
                    spill.unlink(missing_ok=True)

        return fill

    def part_files(self, index: int) -> list[Path]:
        """The part-NNNNNN files in the shard's folder, in commit order (whatever DONE.json says)."""
        d = self.shard_dir(index)
        if not d.is_dir():
            return []
        return sorted(p for p in d.iterdir() if PART_RE.match(p.name))

    def parts(self, index: int, done: Any = UNREAD) -> list[Path]:
        """The files holding a shard's committed rows: its compacted file when DONE.json names one,
        else its parts in commit order, after a compacted file no DONE.json names when the parts
        do not hold every row (DONE.json removed by hand after the parts were: it is the only copy)."""
        if done is UNREAD:
            done = self.done_record(index)
        compacted = self.compacted(index, done)
        if compacted is not None:
            return [compacted]
        parts = self.part_files(index)
        stray = self.shard_dir(index) / self.compacted_name
        if done is None and _regular_file(stray) and not covers(self.shard(index), parts, self.schema):
            return [stray, *parts]
        return parts

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

    def clean_temporaries(self, index: int, done: Any = UNREAD) -> int:
        """Remove what a killed writer left (call under the shard lock): temporaries, and by the
        compaction rule parts of a shard whose DONE.json names its compacted file, or a compacted
        file that DONE.json does not name while the parts hold every row. done: the shard's DONE.json
        as the caller read it (None: none), read here once when not given. Never follows a symlink."""
        if done is UNREAD:
            done = self.done_record(index)
        return self.remove_leftovers(index, done, temporaries=True)

    def remove_leftovers(self, index: int, done: Optional[dict[str, Any]], temporaries: bool = False) -> int:
        """Remove leftovers of a killed compaction (and temporaries if asked); the count removed.
        done: the shard's DONE.json as read once by the caller (None: none).

        Parts go only once the compacted file DONE.json names is there with every row of the shard
        (else RunDirError, nothing removed); a compacted file DONE.json does not name goes only when
        the parts hold every row. Safe only where no writer can be mid-compaction: under the shard
        lock, or in merge (under the run lock) for a shard with DONE.json."""
        d = self.shard_dir(index)
        if not d.is_dir():
            return 0
        compacted = self.compacted(index, done)
        files = [p for p in d.iterdir() if _regular_file(p)]
        doomed = [p for p in files if temporaries and p.name.startswith(TMP_PREFIX)]
        parts = sorted(p for p in files if PART_RE.match(p.name))
        if compacted is not None and parts:
            self.check_compacted(index, compacted)
            doomed += parts
        strays = [p for p in files if COMPACTED_RE.match(p.name)]
        if compacted is None and strays and covers(self.shard(index), parts, self.schema):
            doomed += strays
        for p in doomed:
            p.unlink(missing_ok=True)
        return len(doomed)

    def check_compacted(self, index: int, path: Path) -> None:
        """RunDirError unless the compacted file DONE.json names is there with every row of the shard."""
        rows = self.shard(index).rows
        found = count_rows(path) if path.is_file() else None
        if found == rows:
            return
        what = "is missing" if found is None else f"holds {found} rows of {rows}"
        raise RunDirError(
            f"shard {index}: {self.done_path(index)} names {path.name}, which {what}; the shard's other files "
            f"are kept. Remove {self.done_path(index)}, then `batchinfer resume {self.path}` (or the same "
            f"`batchinfer run`) seals it again from what is committed, redoing only missing rows"
        )


def _regular_file(p: Path) -> bool:
    """A regular file, not a symlink (cleanup never follows one)."""
    return p.is_file() and not p.is_symlink()
