"""output.reuse: earlier run directories' answers, found by request digest. The index is built once
per worker from their committed parts (only the digest and error columns read); an answer's columns
are read from its file when a request first asks for one of them."""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchinfer.errors import ConfigError
from batchinfer.rundir.schema import DIGEST_COLUMN, REUSED_COLUMN, jsonl_columns
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


def checked_reuse(value: Any, run: RunDir) -> Optional[list[str]]:
    """output.reuse for run.yaml: absolute paths of run directories whose answers can be reused (None:
    none); ConfigError when one cannot, or when run's own directory (an earlier version's) cannot
    record digests."""
    paths = [str(open_reuse_dir(p, run.path).path) for p in reuse_paths(value)] or None
    if paths and run.exists() and DIGEST_COLUMN not in run.schema.names:
        raise ConfigError(
            f"output.reuse: {run.path} was made by batchinfer {run.run.get('batchinfer', 'an earlier version')} "
            f"without request digests; reusing answers needs a new run directory (another output.dir)"
        )
    return paths


def _read(run: RunDir, path: Path, columns: list[str]) -> pa.Table:
    """Some columns of one committed file of run."""
    if path.suffix == ".jsonl":
        return jsonl_columns(path.read_bytes(), run.schema, columns)
    return pq.read_table(path, columns=columns)


class ReuseIndex:
    """Answers of earlier runs by request digest; on equal digests the first directory listed wins."""

    def __init__(self, paths: list[str], columns: list[str]):
        """paths: output.reuse; columns: this run's output columns (its answer columns are taken)."""
        self.answer_columns = [c for c in columns if c not in NOT_ANSWER]
        self.files: list[tuple[RunDir, Path]] = []
        digests, file_of, position = [], [], []
        for path in paths:
            run = open_reuse_dir(path)
            for shard in run.shards():
                for file in run.shard_folder(shard.index).committed_files():
                    d, p = self._file_digests(run, file)
                    digests.append(d)
                    position.append(p)
                    file_of.append(np.full(len(d), len(self.files), dtype=np.int32))
                    self.files.append((run, file))
        all_digests = np.concatenate(digests) if digests else np.empty(0, DIGEST_DTYPE)
        order = np.argsort(all_digests, kind="stable")  # stable: the first file (and directory) first
        self.digests = all_digests[order]
        self.file_of = np.concatenate(file_of)[order] if digests else np.empty(0, np.int32)
        self.position = np.concatenate(position)[order] if digests else np.empty(0, np.int32)
        self._tables: OrderedDict[int, pa.Table] = OrderedDict()
        log.info("output.reuse: %d answers indexed from %s", len(self.digests), ", ".join(paths))

    @staticmethod
    def _file_digests(run: RunDir, file: Path) -> tuple[np.ndarray, np.ndarray]:
        """(digests, positions) of a file's rows the engine answered without error."""
        table = _read(run, file, [DIGEST_COLUMN, "error"])
        digest = table.column(DIGEST_COLUMN)
        usable = pc.and_(pc.is_valid(digest), pc.is_null(table.column("error"))).to_numpy(zero_copy_only=False)
        positions = np.flatnonzero(usable).astype(np.int32)
        values = digest.filter(pa.array(usable)).to_numpy(zero_copy_only=False)
        return values.astype(DIGEST_DTYPE), positions

    def answer(self, digest: str) -> Optional[dict[str, Any]]:
        """The answer columns of the earlier row with this request digest; None when there is none
        (or its file is gone: an earlier run compacted meanwhile; the engine answers instead)."""
        key = np.bytes_(digest.encode())
        i = int(np.searchsorted(self.digests, key))
        if i >= len(self.digests) or self.digests[i] != key:
            return None
        try:
            table = self._table(int(self.file_of[i]))
        except OSError as e:
            log.warning("output.reuse: cannot read %s (%s); the engine answers instead", self.files[self.file_of[i]], e)
            return None
        return table.slice(int(self.position[i]), 1).to_pylist()[0]

    def _table(self, n: int) -> pa.Table:
        """The answer columns of indexed file n, read once while it stays among CACHED_FILES."""
        table = self._tables.pop(n, None)
        if table is None:
            run, file = self.files[n]
            table = _read(run, file, [c for c in self.answer_columns if c in run.schema.names])
        self._tables[n] = table
        while len(self._tables) > CACHED_FILES:
            self._tables.popitem(last=False)
        return table
