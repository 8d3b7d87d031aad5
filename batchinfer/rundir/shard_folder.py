"""One shard's folder of a run directory: its parts, progress.json, DONE.json, and the seal."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Optional, Protocol, TypeVar

import pyarrow as pa
import pyarrow.parquet as pq

from batchinfer import faults
from batchinfer.durable import (
    TMP_PREFIX,
    fsync_dir,
    publish_new,
    publish_stream,
    read_json,
    temporary_name,
    write_json,
)
from batchinfer.errors import RunDirError
from batchinfer.inputs.shards import Shard
from batchinfer.rundir.done import DoneRecord
from batchinfer.rundir.shardrows import ShardRows, count_rows, covers
from batchinfer.rundir.tables import group_rows, read_table, table_bytes

log = logging.getLogger("batchinfer")

PART_RE = re.compile(r"^part-(\d{6})\.(parquet|jsonl)$")
# A finished shard's parts compacted into one file sorted by row; DONE.json names it (the rule:
# named -> it holds the shard and leftover parts are ignored; not named -> parts hold the shard and
# a file of this name is a leftover of a killed compaction).
COMPACTED_RE = re.compile(r"^rows\.(parquet|jsonl)$")
# A shard seals once: a view read while it sealed is read again, and the second view is stable.
SNAPSHOT_TRIES = 3
T = TypeVar("T")


class ShardsOf(Protocol):
    """What a shard's folder needs of its run directory (store.RunDir is one)."""

    @property
    def path(self) -> Path: ...

    @property
    def schema(self) -> pa.Schema: ...

    @property
    def part_format(self) -> str: ...

    def shard_dir(self, index: int) -> Path: ...

    def shard(self, index: int) -> Shard: ...


class _Unread:
    """The default of a `done` argument: the caller has not read DONE.json (None means: it has none)."""


UNREAD: Any = _Unread()


@dataclass(frozen=True)
class ShardFolder:
    """The folder of one shard of a run: its files, reads, commits, cleanup and seal."""

    run: ShardsOf
    index: int

    @property
    def path(self) -> Path:
        """The folder of the shard's parts and markers."""
        return self.run.shard_dir(self.index)

    @property
    def done_path(self) -> Path:
        """The shard's DONE.json."""
        return self.path / "DONE.json"

    @property
    def progress_path(self) -> Path:
        """The shard's progress.json."""
        return self.path / "progress.json"

    def is_done(self) -> bool:
        """Whether the shard's DONE.json exists."""
        return self.done_path.is_file()

    @property
    def compacted_name(self) -> str:
        """The name of a finished shard's compacted file: rows.parquet, or rows.jsonl for JSONL parts."""
        return f"rows.{self.run.part_format}"

    def done_record(self) -> Optional[DoneRecord]:
        """The shard's DONE.json, or None while it is not finished."""
        try:
            return read_json(self.done_path)  # type: ignore[no-any-return]
        except FileNotFoundError:
            return None

    def compacted(self, done: Any = UNREAD) -> Optional[Path]:
        """The shard's compacted file when its DONE.json names one (done: that record as already
        read, None for no DONE.json; read here when not given)."""
        if done is UNREAD:
            done = self.done_record()
        name = (done or {}).get("compacted")
        if not name:
            return None
        if not COMPACTED_RE.match(str(name)):  # DONE.json is data: never a path out of the folder
            raise RunDirError(f"{self.done_path}: 'compacted' is {name!r}, not rows.parquet or rows.jsonl")
        return self.path / name

    def finish(self, done: DoneRecord) -> DoneRecord:
        """Seal the shard (under its lock) when its committed rows are exactly its range: merge its files
        into one file sorted by row (a window at a time), check its row count, write DONE.json naming
        it (the commit point), then remove the parts; returns the DONE record. A later copy of a row
        is dropped (the first committed copy is kept, and logged); missing rows or rows outside the
        range raise RunDirError and nothing is sealed. A kill at any step leaves either the
        committed files + no DONE (a compacted file then is a leftover copy of the parts) or DONE
        naming a whole file."""
        sealed = self.done_record()  # read once: a second read could disagree (NFS)
        if self.compacted(sealed) is not None:  # finished already: its rows live in the compacted file
            self.remove_temporaries_and_leftovers(sealed)
            return sealed  # type: ignore[return-value]
        shard = self.run.shard(self.index)
        folder = self.path
        target = folder / self.compacted_name
        sources = self.committed_files(sealed)
        rows = ShardRows(shard, sources, self.run.schema)
        if not rows.check.complete:
            raise RunDirError(
                f"shard {self.index} not sealed: its committed rows are not rows {shard.start}..{shard.stop - 1} "
                f"({rows.check.problem()}); {folder} is left as it is: `batchinfer resume` redoes missing rows, "
                f"a file holding another shard's rows must be moved away by hand"
            )
        if rows.check.dropped:
            log.warning(
                "shard %d: %s were committed (two writers, or a part published twice); keeping each row's "
                "first committed copy",
                self.index,
                rows.check.duplicates_text(),
            )
        adopted = target in sources  # rows.* no DONE.json names, holding rows no part holds
        if not (adopted and rows.in_order):
            # Over a killed compaction's copy (the parts hold every row) or the adopted file, by an
            # atomic rename: the name never goes missing, even for a writer that lost its lock.
            fill = self._compacted_writer(rows)
            replace = target if adopted or target.exists() else None
            if not publish_stream(target, fill, faults.COMPACT_WRITE, replace=replace):
                raise RunDirError(f"{target}: written meanwhile by another writer; the shard lock was not held")
        written = count_rows(target) if target.is_file() else None
        if written != shard.rows:
            what = "is gone (removed meanwhile by another writer)" if written is None else f"holds {written} rows"
            raise RunDirError(f"{target}: {what}, shard {self.index} has {shard.rows}; not sealed")
        record = DoneRecord(**done)
        record["compacted"] = target.name
        if rows.check.dropped:
            record["duplicates_dropped"] = rows.check.dropped
        write_json(self.done_path, record)
        faults.point(faults.AFTER_COMPACT_DONE)
        # The parts go only while the file DONE.json names still holds every row: a second writer
        # (an earlier incarnation on a failing node) may have removed it as a leftover meanwhile.
        self.check_compacted(target)
        for n, p in enumerate(q for q in sources if q != target):
            p.unlink(missing_ok=True)
            if n == 0:
                faults.point(faults.IN_COMPACT_CLEANUP)
        fsync_dir(folder)
        return record

    def _compacted_writer(self, rows: ShardRows) -> Callable[[BinaryIO], None]:
        """What writes a shard's rows as one file sorted by row, in the part format, a window at a time."""

        size = group_rows(rows.row_bytes)
        schema = self.run.schema

        def fill(f: BinaryIO) -> None:
            if self.run.part_format == "jsonl":
                for _, data in rows.windows(size, lines=True):
                    f.write(data)  # type: ignore[arg-type]
                return
            # Over several windows, each part is read once through a scratch file beside the parts
            # (a temporary: a killed compaction's is removed with the others); a shard of one
            # window (the default 10,000 rows) reads each part once anyway and needs none.
            several = rows.shard.stop - rows.shard.start > size
            spill = temporary_name(rows.files[0].path.with_name("compact.arrow")) if rows.files and several else None
            try:
                with pq.ParquetWriter(f, schema, compression="zstd") as writer:
                    for _, table in rows.windows(size, lines=False, spill=spill):
                        writer.write_table(table, row_group_size=size)  # type: ignore[arg-type]
            finally:
                if spill is not None:
                    spill.unlink(missing_ok=True)

        return fill

    def part_files(self) -> list[Path]:
        """Every part-NNNNNN file in the shard's folder, in commit order, whatever DONE.json says (a
        sealed shard's leftover parts too: committed_files says which files hold its rows)."""
        d = self.path
        if not d.is_dir():
            return []
        return sorted(p for p in d.iterdir() if PART_RE.match(p.name))

    def committed_files(self, done: Any = UNREAD) -> list[Path]:
        """The files holding the shard's committed rows: its compacted file when DONE.json names one,
        else its parts in commit order, after a compacted file no DONE.json names when the parts
        do not hold every row (DONE.json removed by hand after the parts were: it is the only copy)."""
        if done is UNREAD:
            done = self.done_record()
        compacted = self.compacted(done)
        if compacted is not None:
            return [compacted]
        parts = self.part_files()
        stray = self.path / self.compacted_name
        if done is None and _regular_file(stray) and not covers(self.run.shard(self.index), parts, self.run.schema):
            return [stray, *parts]
        return parts

    def read_committed(self, read: Callable[[Path], T]) -> list[tuple[Path, T]]:
        """read(file) of each file holding the shard's committed rows, as one consistent view
        without the shard lock, while a writer may be sealing it: the parts listed before the seal
        (none is removed before DONE.json is written), else the compacted file DONE.json names
        (never removed). A file gone while read, or DONE.json written meanwhile, starts it again,
        so no committed row is missed and none is read twice (parts and their compacted copy)."""
        for _ in range(SNAPSHOT_TRIES):
            done = self.done_record()
            try:
                out = [(p, read(p)) for p in self.committed_files(done)]
            except FileNotFoundError:
                continue  # sealed meanwhile: its parts are gone, DONE.json names the compacted file
            if done is not None or self.done_record() is None:
                return out
        raise RunDirError(f"shard {self.index}: its files kept changing while read ({SNAPSHOT_TRIES} tries)")

    def read_rows(self, columns: Optional[list[str]] = None) -> pa.Table:
        """All committed rows of the shard (commit order, or row order once compacted)."""
        schema = self.run.schema
        tables = [read_table(p, schema, columns) for p in self.committed_files()]
        if not tables:
            return (schema if columns is None else pa.schema([schema.field(c) for c in columns])).empty_table()
        return pa.concat_tables(tables)

    def write_part(self, table: pa.Table) -> Path:
        """Commit rows as the shard's next part: whole or absent."""
        parts = self.part_files()
        n = int(PART_RE.match(parts[-1].name).group(1)) + 1 if parts else 0  # type: ignore[union-attr]
        fmt = self.run.part_format
        return publish_new(self.path, lambda k: f"part-{k:06d}.{fmt}", n, table_bytes(table, fmt), faults.PART_WRITE)

    def remove_temporaries_and_leftovers(self, done: Any = UNREAD) -> int:
        """Remove what a killed writer left (call under the shard lock): its temporaries, and the
        leftovers of a killed compaction (remove_compaction_leftovers: parts of a shard whose
        DONE.json names its compacted file, or a compacted file no DONE.json names while the parts
        hold every row); the count removed. done: the shard's DONE.json as the caller read it (None:
        none), read here once when not given. Nothing is removed when the compacted file DONE.json
        names is not whole (RunDirError). Never follows a symlink."""
        if done is UNREAD:
            done = self.done_record()
        removed = self.remove_compaction_leftovers(done)  # first: it may refuse, removing nothing
        return removed + self.remove_temporaries()

    def remove_temporaries(self) -> int:
        """Remove the temporaries (.tmp-*) killed writers left in the shard's folder (call under the
        shard lock: a live writer's temporary is its file being written); the count removed."""
        d = self.path
        if not d.is_dir():
            return 0
        doomed = [p for p in d.iterdir() if p.name.startswith(TMP_PREFIX) and _regular_file(p)]
        for p in doomed:
            p.unlink(missing_ok=True)
        return len(doomed)

    def remove_compaction_leftovers(self, done: Optional[DoneRecord]) -> int:
        """Remove leftovers of a killed compaction; the count removed. done: the shard's DONE.json as
        read once by the caller (None: none).

        Parts go only once the compacted file DONE.json names is there with every row of the shard
        (else RunDirError, nothing removed); a compacted file DONE.json does not name goes only when
        the parts hold every row. Safe only where no writer can be mid-compaction: under the shard
        lock, or in merge (under the run lock) for a shard with DONE.json."""
        d = self.path
        if not d.is_dir():
            return 0
        compacted = self.compacted(done)
        files = [p for p in d.iterdir() if _regular_file(p)]
        parts = sorted(p for p in files if PART_RE.match(p.name))
        doomed = []
        if compacted is not None and parts:
            self.check_compacted(compacted)
            doomed += parts
        strays = [p for p in files if COMPACTED_RE.match(p.name)]
        if compacted is None and strays and covers(self.run.shard(self.index), parts, self.run.schema):
            doomed += strays
        for p in doomed:
            p.unlink(missing_ok=True)
        return len(doomed)

    def check_compacted(self, path: Path) -> None:
        """RunDirError unless the compacted file DONE.json names is there with every row of the shard."""
        rows = self.run.shard(self.index).rows
        found = count_rows(path) if path.is_file() else None
        if found == rows:
            return
        what = "is missing" if found is None else f"holds {found} rows of {rows}"
        done = self.done_path
        raise RunDirError(
            f"shard {self.index}: {done} names {path.name}, which {what}; the shard's other files "
            f"are kept. Remove {done}, then `batchinfer resume {self.run.path}` (or the same "
            f"`batchinfer run`) seals it again from what is committed, redoing only missing rows"
        )


def _regular_file(p: Path) -> bool:
    """A regular file, not a symlink (cleanup never follows one)."""
    return p.is_file() and not p.is_symlink()
