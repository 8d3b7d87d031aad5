"""Open inputs, convert them once to Arrow, stable row ids and the shard plan."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa

from batchinfer.errors import InputError

FORMATS_BY_SUFFIX = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet"}


@dataclass(frozen=True)
class Shard:
    """One contiguous range of input rows, [start, stop)."""

    index: int
    start: int
    stop: int

    @property
    def rows(self) -> int:
        """Number of rows in the shard."""
        return self.stop - self.start


def detect_format(path: str, fmt: Optional[str]) -> str:
    """The input format: as configured, else from the file suffix."""
    if fmt:
        return fmt
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS_BY_SUFFIX:
        known = ", ".join(sorted(FORMATS_BY_SUFFIX))
        raise InputError(
            f"{path}: cannot tell the format from the suffix {suffix!r} (known: {known}); set input.format"
        )
    return FORMATS_BY_SUFFIX[suffix]


def file_fingerprint(path: Path, previous: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Content hash of the input; reused when size and mtime match the previous record."""
    st = path.stat()
    if previous and previous.get("size") == st.st_size and previous.get("mtime_ns") == st.st_mtime_ns:
        return previous
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "fingerprint": h.hexdigest()}


def check_input_path(path: str) -> Path:
    """Resolve input.path; a missing file is an error naming it."""
    p = Path(path).expanduser().resolve()
    if not p.exists():
        raise InputError(f"input.path {path}: no such file (resolved to {p})")
    if not p.is_file():
        raise InputError(f"input.path {path}: not a file")
    return p


def scan_jsonl(path: Path) -> int:
    """Check every line decodes and parses; return the row count. Errors name file:line."""
    rows = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise InputError(
                    f"{path}:{lineno}: invalid UTF-8 at byte {e.start}; re-encode the file as UTF-8"
                ) from None
            if lineno == 1:
                line = line.removeprefix("\ufeff")
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(
                    f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno}); fix or remove the line"
                ) from None
            if not isinstance(obj, dict):
                raise InputError(f"{path}:{lineno}: expected a JSON object per line, got {type(obj).__name__}")
            rows += 1
    return rows


def _load(path: Path, fmt: str, cache_dir: Path) -> Any:
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    if fmt in ("jsonl", "json"):
        if fmt == "jsonl":
            scan_jsonl(path)
        return datasets.Dataset.from_json(str(path), cache_dir=str(cache_dir))
    if fmt == "parquet":
        return datasets.Dataset.from_parquet(str(path), cache_dir=str(cache_dir))
    raise InputError(f"input.format={fmt!r} is not supported (jsonl, json, parquet)")


def convert_input(path: Path, fmt: str, dest: Path, id_column: Optional[str], columns: Optional[list[str]]) -> int:
    """Convert the input once into an Arrow dataset at dest; return its row count."""
    if path.stat().st_size == 0:
        raise InputError(f"{path}: the file is empty; there is nothing to run")
    tmp = dest.with_name(dest.name + ".tmp")
    cache = dest.with_name(".hf-cache")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        ds = _load(path, fmt, cache)
        if len(ds) == 0:
            raise InputError(f"{path}: no rows; there is nothing to run")
        if id_column is not None:
            if id_column not in ds.column_names:
                raise InputError(
                    f"{path}: input.id_column={id_column!r} is not a column (columns: {', '.join(ds.column_names)})"
                )
            check_ids(path, ds.data.column(id_column))
        if columns:
            missing = [c for c in columns if c not in ds.column_names]
            if missing:
                raise InputError(
                    f"{path}: input.columns names {missing} which the input lacks (columns: {', '.join(ds.column_names)})"
                )
        ds.save_to_disk(str(tmp))
        os.replace(tmp, dest)
        return len(ds)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)


def check_ids(path: Path, ids: pa.ChunkedArray) -> None:
    """Ids must be present and unique; errors name the id and its rows."""
    if ids.null_count:
        row = ids.to_pylist().index(None)
        raise InputError(f"{path}: row {row} has a null id; every row needs an id")
    seen: dict[Any, int] = {}
    for row, value in enumerate(ids.to_pylist()):
        if value in seen:
            raise InputError(f"{path}: duplicate id {value!r} in rows {seen[value]} and {row}; ids must be unique")
        seen[value] = row


def open_input(dest: Path) -> Any:
    """Memory-map the converted input dataset."""
    import datasets

    datasets.disable_progress_bars()
    return datasets.load_from_disk(str(dest))


def plan_shards(
    num_rows: int, num_shards: Optional[int], rows_per_shard: Optional[int], default_rows: int
) -> list[Shard]:
    """Split rows into contiguous shards, by count or by size."""
    if num_shards is not None:
        n = min(num_shards, num_rows)
        bounds = [num_rows * i // n for i in range(n + 1)]
    else:
        size = rows_per_shard or default_rows
        bounds = list(range(0, num_rows, size)) + [num_rows]
    return [Shard(i, a, b) for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False))]
