"""Rows and tokens per LoRA adapter (model.lora) of a run's committed rows, for `report`: read from
each shard's committed files (the compacted file of a finished shard, else its parts)."""

from __future__ import annotations

from typing import Optional, TypedDict

import pyarrow as pa
import pyarrow.compute as pc

from batchinfer.rundir.committed import committed_columns
from batchinfer.rundir.store import RunDir

BASE = "(base model)"  # the label of rows without an adapter
UNKNOWN_KIND = "adapter"  # the error kind of a row naming no adapter of the run (requests/build.py)
COLUMNS = ("adapter", "prompt_tokens", "output_tokens", "error")


class AdapterRow(TypedDict):
    """One adapter's committed rows in report.json's `adapters` (adapter None: the base model;
    unknown: the name rows asked for that model.lora.adapters lacks, all of them error rows)."""

    adapter: Optional[str]
    unknown: bool
    rows: int
    error_rows: int
    prompt_tokens: int
    output_tokens: int


def adapter_rows(run: RunDir) -> Optional[list[AdapterRow]]:
    """Committed rows, error rows and tokens per adapter, by name (the base model first); None for
    a run without adapters."""
    if "adapter" not in run.schema.names:
        return None
    t = committed_columns(run, [c for c in COLUMNS if c in run.schema.names])
    t = t.append_column("failed", pc.cast(pc.is_valid(t["error"]), pa.int64()))
    # a row naming no adapter of the run is an error row of kind adapter, carrying the name it asked for
    unknown = pc.fill_null(pc.equal(pc.struct_field(t["error"], "kind"), UNKNOWN_KIND), False)
    t = t.append_column("unknown", unknown)
    sums = t.group_by(["adapter", "unknown"]).aggregate(
        [("failed", "count"), ("failed", "sum"), ("prompt_tokens", "sum"), ("output_tokens", "sum")]
    )
    out = [
        AdapterRow(
            adapter=r["adapter"],
            unknown=r["unknown"],
            rows=r["failed_count"],
            error_rows=r["failed_sum"] or 0,
            prompt_tokens=r["prompt_tokens_sum"] or 0,
            output_tokens=r["output_tokens_sum"] or 0,
        )
        for r in sums.to_pylist()
    ]
    return sorted(out, key=lambda a: (a["adapter"] is not None, a["unknown"], a["adapter"] or ""))


def adapter_label(a: AdapterRow) -> str:
    """An adapter's name in report.md: BASE for the base model, `(unknown: NAME)` for a name the
    run's adapters lack."""
    if a["adapter"] is None:
        return BASE
    return f"(unknown: {a['adapter']})" if a.get("unknown") else a["adapter"]


def loads_line(loads: list[Optional[int]]) -> list[str]:
    """report.md's line on the engine's adapter loads (shards' adapter_loads; none counted: no line)."""
    counted = [n for n in loads if n is not None]
    if not counted:
        return []
    where = f" over {len(counted)} shards (at most {max(counted):,} in one)" if len(counted) > 1 else ""
    return [
        "",
        f"Adapter loads: {sum(counted):,}{where}, each the engine moving an adapter into one of its "
        "model.lora.max_loras slots (rows are sent adapter by adapter so that this stays small).",
    ]


def adapter_lines(rows: list[AdapterRow], loads: Optional[list[Optional[int]]] = None) -> list[str]:
    """report.md's table of rows and tokens per adapter, and the engine's adapter loads (per shard)."""
    lines = [
        "## Adapters",
        "",
        "| adapter | rows | error rows | prompt tokens | output tokens |",
        "|---|---:|---:|---:|---:|",
    ]
    for a in rows:
        lines.append(
            f"| {adapter_label(a)} | {a['rows']:,} | {a['error_rows']:,} | {a['prompt_tokens']:,} | {a['output_tokens']:,} |"
        )
    return lines + loads_line(loads or [])
