"""The run directory on disk: run.yaml, plan, atomic parts, progress, DONE (locks: locks.py)."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, Optional

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from batchinfer import faults
from batchinfer.config.schema import Config, to_config
from batchinfer.errors import RunDirError
from batchinfer.inputs.shards import Shard
from batchinfer.rundir.durable import (
    TMP_PREFIX,
    atomic_write,
    fsync_dir,
    publish_new,
    publish_stream,
    read_json,
    temporary_name,
    write_json,
)
from batchinfer.rundir.schema import schema_from_text
from batchinfer.rundir.shardrows import ShardRows, count_rows, covers
from batchinfer.rundir.tables import group_rows, read_table, table_bytes
from batchinfer.security import redact_config

log = logging.getLogger("batchinfer")

PART_RE = re.compile(r"^part-(\d{6})\.(parquet|jsonl)$")
# A finished shard's parts compacted into one file sorted by row; DONE.json names it (the rule:
# named -> it holds the shard and leftover parts are ignored; not named -> parts hold the shard and
# a file of this name is a leftover of a killed compaction).
COMPACTED_RE = re.compile(r"^rows\.(parquet|jsonl)$")
OUTPUT_EXT = {"jsonl": "jsonl", "openai": "jsonl", "parquet": "parquet", "hf": "parquet"}


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
            self.remove_temporaries_and_leftovers(index, sealed)
            return sealed  # type: ignore[return-value]
        shard = self.shard(index)
        folder = self.shard_dir(index)
        target = folder / self.compacted_name
        sources = self.committed_files(index, sealed)
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
            if not publish_stream(target, fill, faults.COMPACT_WRITE, replace=replace):
                raise RunDirError(f"{target}: written meanwhile by another writer; the shard lock was not held")
        written = count_rows(target) if target.is_file() else None
        if written != shard.rows:
            what = "is gone (removed meanwhile by another writer)" if written is None else f"holds {written} rows"
            raise RunDirError(f"{target}: {what}, shard {index} has {shard.rows}; not sealed")
        record = dict(done, compacted=target.name)
        if rows.check.dropped:
            record["duplicates_dropped"] = rows.check.dropped
        write_json(self.done_path(index), record)
        faults.point(faults.AFTER_COMPACT_DONE)
        # The parts go only while the file DONE.json names still holds every row: a second writer
        # (an earlier incarnation on a failing node) may have removed it as a leftover meanwhile.
        self.check_compacted(index, target)
        for n, p in enumerate(q for q in sources if q != target):
            p.unlink(missing_ok=True)
            if n == 0:
                faults.point(faults.IN_COMPACT_CLEANUP)
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
        """Every part-NNNNNN file in the shard's folder, in commit order, whatever DONE.json says (a
        sealed shard's leftover parts too: committed_files says which files hold its rows)."""
        d = self.shard_dir(index)
        if not d.is_dir():
            return []
        return sorted(p for p in d.iterdir() if PART_RE.match(p.name))

    def committed_files(self, index: int, done: Any = UNREAD) -> list[Path]:
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
        tables = [read_table(p, self.schema, columns) for p in self.committed_files(index)]
        if not tables:
            schema = self.schema if columns is None else pa.schema([self.schema.field(c) for c in columns])
            return schema.empty_table()
        return pa.concat_tables(tables)

    def write_part(self, index: int, table: pa.Table) -> Path:
        """Commit rows as the shard's next part: whole or absent."""
        parts = self.part_files(index)
        n = int(PART_RE.match(parts[-1].name).group(1)) + 1 if parts else 0  # type: ignore[union-attr]
        fmt = self.part_format
        return publish_new(
            self.shard_dir(index), lambda k: f"part-{k:06d}.{fmt}", n, table_bytes(table, fmt), faults.PART_WRITE
        )

    def remove_temporaries_and_leftovers(self, index: int, done: Any = UNREAD) -> int:
        """Remove what a killed writer left (call under the shard lock): its temporaries, and the
        leftovers of a killed compaction (remove_compaction_leftovers: parts of a shard whose
        DONE.json names its compacted file, or a compacted file no DONE.json names while the parts
        hold every row); the count removed. done: the shard's DONE.json as the caller read it (None:
        none), read here once when not given. Nothing is removed when the compacted file DONE.json
        names is not whole (RunDirError). Never follows a symlink."""
        if done is UNREAD:
            done = self.done_record(index)
        removed = self.remove_compaction_leftovers(index, done)  # first: it may refuse, removing nothing
        return removed + self.remove_temporaries(index)

    def remove_temporaries(self, index: int) -> int:
        """Remove the temporaries (.tmp-*) killed writers left in the shard's folder (call under the
        shard lock: a live writer's temporary is its file being written); the count removed."""
        d = self.shard_dir(index)
        if not d.is_dir():
            return 0
        doomed = [p for p in d.iterdir() if p.name.startswith(TMP_PREFIX) and _regular_file(p)]
        for p in doomed:
            p.unlink(missing_ok=True)
        return len(doomed)

    def remove_compaction_leftovers(self, index: int, done: Optional[dict[str, Any]]) -> int:
        """Remove leftovers of a killed compaction; the count removed. done: the shard's DONE.json as
        read once by the caller (None: none).

        Parts go only once the compacted file DONE.json names is there with every row of the shard
        (else RunDirError, nothing removed); a compacted file DONE.json does not name goes only when
        the parts hold every row. Safe only where no writer can be mid-compaction: under the shard
        lock, or in merge (under the run lock) for a shard with DONE.json."""
        d = self.shard_dir(index)
        if not d.is_dir():
            return 0
        compacted = self.compacted(index, done)
        files = [p for p in d.iterdir() if _regular_file(p)]
        parts = sorted(p for p in files if PART_RE.match(p.name))
        doomed = []
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
