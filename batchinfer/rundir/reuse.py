"""output.reuse: earlier run directories' answers, found by request digest. The index is built once
per worker from their committed parts (only the digest and error columns read); an answer's columns
are read from its file when a request first asks for one of them."""

from __future__ import annotations

import logging
from collections import OrderedDict
from functools import partial
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from batchinfer.errors import ConfigError, RunDirError
from batchinfer.rundir.committed import read_committed
from batchinfer.rundir.model_record import identity_digest
from batchinfer.rundir.schema import DIGEST_COLUMN, REUSED_COLUMN, OutputRow
from batchinfer.rundir.store import RunDir

log = logging.getLogger("batchinfer")

NOT_ANSWER = frozenset({"row", "id", "input", DIGEST_COLUMN, REUSED_COLUMN})  # this run's own, per row
CACHED_FILES = 4  # answer tables kept in memory: a shard's requests mostly hit one earlier shard's file
DIGEST_DTYPE = "S32"  # hex digests as fixed-size bytes: 32 bytes per indexed row, sorted for searchsorted


def reuse_paths(value: Any) -> list[str]:
    """output.reuse as a list of paths (one path is a list of one; unset is empty)."""
    if value is None or value == "":
        return []
    if isinstance(value, (str, Path)):
        return [str(value)]
    return [str(v) for v in value]


def open_reuse_dir(path: str, own: Optional[Path] = None) -> RunDir:
    """The run directory output.reuse names; ConfigError naming it when it is none, is this run's
    own, or was made before parts kept request digests."""
    run = RunDir(path)
    if not run.exists():
        raise ConfigError(f"output.reuse: {path} is not a run directory (no {run.run_yaml}); name one `run` made")
    if own is not None and run.path == own:
        raise ConfigError(f"output.reuse: {path} is this run's own directory; name an earlier run's")
    if DIGEST_COLUMN not in run.schema.names:
        made = run.run.get("batchinfer", "an earlier version")
        raise ConfigError(
            f"output.reuse: {run.path} was made by batchinfer {made}, whose parts do not record which "
            f"request each answer is for ({DIGEST_COLUMN}), so none of its answers can be reused: "
            "run it again with this batchinfer (it then becomes reusable), or drop it from output.reuse"
        )
    return run


def same_model(other: RunDir, identity: Optional[str]) -> bool:
    """Whether an output.reuse directory was prepared with the model files this run's identity
    digest names; logged, naming it, when not (none recorded on either side: not the same)."""
    theirs = identity_digest(other.run)
    if identity is not None and theirs == identity:
        return True
    if theirs is None:
        why = "was prepared before batchinfer recorded a model's files (model_identity in run.yaml)"
    elif identity is None:
        why = "records model files, and this run (prepared by an earlier batchinfer) records none"
    else:
        why = (
            "was prepared with other model files (another model, or other weights at the same path; or "
            "known by another model.identity)"
        )
    log.warning("output.reuse: %s %s; none of its answers are reused", other.path, why)
    return False


def checked_reuse(value: Any, run: RunDir, identity: Optional[str] = None) -> Optional[list[str]]:
    """output.reuse for run.yaml: absolute paths of run directories whose answers can be reused (None:
    none); ConfigError when one cannot, or when run's own directory (an earlier version's) cannot
    record digests. identity: this run's model identity digest (a directory of another is logged)."""
    dirs = [open_reuse_dir(p, run.path) for p in reuse_paths(value)]
    for other in dirs:
        same_model(other, identity)
    paths = [str(other.path) for other in dirs] or None
    if paths and run.exists() and DIGEST_COLUMN not in run.schema.names:
        raise ConfigError(
            f"output.reuse: {run.path} was made by batchinfer {run.run.get('batchinfer', 'an earlier version')} "
            f"without request digests; reusing answers needs a new run directory (another output.dir)"
        )
    return paths


class ReuseIndex:
    """Answers of earlier runs by request digest; on equal digests the first directory listed wins.
    Each answer is found by its file and row number: a file an earlier run's seal removed meanwhile
    (its parts, compacted into one file) is replaced by the shard's committed rows as they are now."""

    def __init__(self, paths: list[str], columns: list[str], identity: Optional[str]):
        """paths: output.reuse; columns: this run's output columns (its answer columns are taken);
        identity: this run's model identity digest (only directories of the same are indexed)."""
        self.answer_columns = [c for c in columns if c not in NOT_ANSWER]
        self.files: list[tuple[RunDir, int, Path]] = []  # (run, shard, file)
        digests, file_of, rows = [], [], []
        for path in paths:
            run = open_reuse_dir(path)
            if not same_model(run, identity):
                continue
            for shard in run.shards():
                # a shard sealed while it is read is read again: every committed row once
                for file, (d, r) in run.shard_folder(shard.index).read_committed(partial(_file_digests, run)):
                    digests.append(d)
                    rows.append(r)
                    file_of.append(np.full(len(d), len(self.files), dtype=np.int32))
                    self.files.append((run, shard.index, file))
        all_digests = np.concatenate(digests) if digests else np.empty(0, DIGEST_DTYPE)
        order = np.argsort(all_digests, kind="stable")  # stable: the first file (and directory) first
        self.digests = all_digests[order]
        self.file_of = np.concatenate(file_of)[order] if digests else np.empty(0, np.int32)
        self.row = np.concatenate(rows)[order] if digests else np.empty(0, np.int64)
        self._tables: OrderedDict[int, _Rows] = OrderedDict()
        log.info("output.reuse: %d answers indexed from %s", len(self.digests), ", ".join(paths))

    def answer(self, digest: str) -> Optional[OutputRow]:
        """The answer columns of the earlier row with this request digest; None when there is none
        (or its shard cannot be read now: the engine answers instead)."""
        key = np.bytes_(digest.encode())
        i = int(np.searchsorted(self.digests, key))
        if i >= len(self.digests) or self.digests[i] != key:
            return None
        n = int(self.file_of[i])
        try:
            return self._table(n).answer(int(self.row[i]))
        except (OSError, RunDirError) as e:
            log.warning("output.reuse: cannot read %s (%s); the engine answers instead", self.files[n][2], e)
            return None

    def _table(self, n: int) -> _Rows:
        """The answer columns of indexed file n (or, once it is gone, of its shard's committed
        files now), read once while it stays among CACHED_FILES."""
        table = self._tables.pop(n, None)
        if table is None:
            run, shard, file = self.files[n]
            columns = ["row", *(c for c in self.answer_columns if c in run.schema.names)]
            try:
                table = _Rows(read_committed(run, file, columns))
            except FileNotFoundError:  # sealed meanwhile: the same rows, in its compacted file
                read = run.shard_folder(shard).read_committed(partial(read_committed, run, columns=columns))
                table = _Rows(pa.concat_tables([t for _, t in read]))
        self._tables[n] = table
        while len(self._tables) > CACHED_FILES:
            self._tables.popitem(last=False)
        return table


def _file_digests(run: RunDir, file: Path) -> tuple[np.ndarray, np.ndarray]:
    """(digests, row numbers) of a file's rows the engine answered without error."""
    table = read_committed(run, file, ["row", DIGEST_COLUMN, "error"])
    digest = table.column(DIGEST_COLUMN)
    usable = pa.array(pc.and_(pc.is_valid(digest), pc.is_null(table.column("error"))).to_numpy(zero_copy_only=False))
    values = digest.filter(usable).to_numpy(zero_copy_only=False)
    rows = table.column("row").filter(usable).to_numpy(zero_copy_only=False).astype(np.int64)
    return values.astype(DIGEST_DTYPE), rows


class _Rows:
    """Committed rows of one file (or shard) found by row number (the first committed copy of a row)."""

    def __init__(self, table: pa.Table):
        rows = table.column("row").to_numpy(zero_copy_only=False)
        self.order = np.argsort(rows, kind="stable")
        self.sorted = rows[self.order]
        self.table = table.drop_columns(["row"])

    def answer(self, row: int) -> Optional[OutputRow]:
        """The row's answer columns; None when it is not there."""
        i = int(np.searchsorted(self.sorted, row))
        if i >= len(self.sorted) or self.sorted[i] != row:
            return None
        return self.table.slice(int(self.order[i]), 1).to_pylist()[0]
