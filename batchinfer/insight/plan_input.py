"""`batchinfer plan`'s input section: rows, shards and array tasks, and a sample of rows (the
input read, nothing converted)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

from batchinfer.config.schema import DEFAULT_ROWS_PER_SHARD, Config
from batchinfer.errors import ConfigError
from batchinfer.insight.plan_records import InputSection


def input_section(c: Config, files: list[Path], sample_rows: int) -> tuple[InputSection, list[dict[str, Any]]]:
    """Input rows, shards and array tasks, plus a sample of rows; reads the input, converts nothing."""
    from batchinfer.inputs.preview import peek
    from batchinfer.inputs.shards import plan_shards

    fmt = c.input.format
    rows, sample = peek(files, fmt, sample_rows)
    if rows == 0:
        raise ConfigError(f"input.path {c.input.path}: no rows; there is nothing to plan")
    _check_id_column(c.input.id_column, files, sample)
    sh = c.sharding
    shards = plan_shards(rows, sh.num_shards, sh.rows_per_shard, DEFAULT_ROWS_PER_SHARD)
    per_task = c.cluster.shards_per_task
    section: InputSection = {
        "path": c.input.path,
        "files": len(files),
        "format": fmt,
        "rows": rows,
        "shards": len(shards),
        "max_rows_per_shard": max(s.rows for s in shards),
        "shards_per_task": per_task,
        "array_tasks": math.ceil(len(shards) / per_task),
    }
    return section, sample


def _check_id_column(column: Optional[str], files: list[Path], sample: list[dict[str, Any]]) -> None:
    """InputError, as validate and the run say it, where the sampled rows lack input.id_column (the
    sample's request ids would raise KeyError further down)."""
    if column is None or all(row.get(column) is not None for row in sample):
        return
    from batchinfer.errors import InputError

    shown = files[0] if len(files) == 1 else f"{files[0].parent}/ ({len(files)} files)"
    names = list(dict.fromkeys(k for row in sample for k in row))
    if column not in names:
        raise InputError(f"{shown}: input.id_column={column!r} is not a column (columns: {', '.join(names)})")
    raise InputError(f"{shown}: input.id_column {column!r} is null or missing in some rows; every row needs an id")
