"""Throughput figures of a run from its progress/DONE records: per shard, totals, the report table."""

from __future__ import annotations

import time
from typing import Any, Optional

from batchinfer.rundir.store import RunDir, read_json

PHASES = ("startup", "prepare", "generate", "commit")  # seconds a task holds its GPUs, by what it does
SERIES_POINTS = 500  # progress.json keeps at most this many {t, rows_done, output_tokens} points


def with_rates(progress: dict[str, Any]) -> dict[str, Any]:
    """A progress record plus output and total (prompt + output) tokens/s over its generate seconds,
    and the prefix-cache hit rate (cached / prompt tokens of engine requests; None when not reported)."""
    gen = progress.get("seconds", {}).get("generate", 0.0)
    prompt, output = progress.get("prompt_tokens", 0), progress.get("output_tokens", 0)
    cache = progress.get("prefix_cache") or {}
    return dict(
        progress,
        output_tokens_per_s=round(output / gen, 2) if gen else None,
        total_tokens_per_s=round((prompt + output) / gen, 2) if gen else None,
        rows_per_s=round(progress.get("rows_done", 0) / gen, 2) if gen else None,
        prefix_cache_hit_rate=round(cache["hits"] / cache["queries"], 4) if cache.get("queries") else None,
    )


def add_point(progress: dict[str, Any]) -> None:
    """Append a time-series point; past SERIES_POINTS, every other point goes (first and last stay)."""
    series = progress["series"]
    series.append(
        {"t": round(time.time(), 1), "rows_done": progress["rows_done"], "output_tokens": progress["output_tokens"]}
    )
    if len(series) > SERIES_POINTS:
        series[:] = series[:-1:2] + series[-1:]


def shard_record(run: RunDir, index: int) -> dict[str, Any]:
    """A shard's latest record (DONE.json, else progress.json, else empty) with its rates."""
    done = run.is_done(index)
    path = run.done_path(index) if done else run.progress_path(index)
    return dict(with_rates(read_json(path) if path.is_file() else {}), done=done)


def shard_stats(run: RunDir) -> list[dict[str, Any]]:
    """One row per shard of the plan: rows, tokens, seconds by phase, rates, errors, time series."""
    out = []
    for shard in run.shards():
        rec = shard_record(run, shard.index)
        seconds = rec.get("seconds", {})
        out.append(
            {
                "shard": shard.index,
                "done": rec["done"],
                "rows": shard.rows,
                "rows_done": rec.get("rows_done", 0),
                "prompt_tokens": rec.get("prompt_tokens", 0),
                "output_tokens": rec.get("output_tokens", 0),
                "seconds": {p: seconds.get(p, 0.0) for p in PHASES},
                "output_tokens_per_s": rec["output_tokens_per_s"],
                "total_tokens_per_s": rec["total_tokens_per_s"],
                "rows_per_s": rec["rows_per_s"],
                "prefix_cache": rec.get("prefix_cache"),
                "prefix_cache_hit_rate": rec["prefix_cache_hit_rate"],
                "errors": rec.get("errors", {}),
                "attempts": rec.get("attempts", 0),
                "series": rec.get("series", []),
                "device": rec.get("device"),
            }
        )
    return out


def totals(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """Sums over shards; tok/s is all tokens over all generate seconds (one task's rate while generating)."""
    keys = ("rows", "rows_done", "prompt_tokens", "output_tokens")
    tot: dict[str, Any] = {k: sum(s[k] for s in shards) for k in keys}
    tot["seconds"] = {p: sum(s["seconds"][p] for s in shards) for p in PHASES}
    caches = [s["prefix_cache"] for s in shards if s["prefix_cache"]]
    prefix = {k: sum(c[k] for c in caches) for k in ("queries", "hits")} if caches else None
    errors: dict[str, int] = {}
    for s in shards:
        for kind, n in s["errors"].items():
            errors[kind] = errors.get(kind, 0) + n
    tot.update(
        with_rates({**tot, "prefix_cache": prefix}),
        shards=len(shards),
        shards_done=sum(s["done"] for s in shards),
        errors=errors,
    )
    return tot


def _num(x: Optional[float], fmt: str = "{:,.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _errors(errors: dict[str, int]) -> str:
    return ", ".join(f"{k} {n}" for k, n in sorted(errors.items())) or "0"


HEADER = (
    "shard",
    "rows",
    "prompt tok",
    "output tok",
    "start-up s",
    "prepare s",
    "generate s",
    "commit s",
    "rows/s",
    "output tok/s",
    "total tok/s",
    "prefix cache hits",
    "errors",
)


def table_row(label: str, r: dict[str, Any], rows: str) -> list[str]:
    """One markdown table row of a shard or of the totals."""
    sec = r["seconds"]
    return [
        label,
        rows,
        f"{r['prompt_tokens']:,}",
        f"{r['output_tokens']:,}",
        *(f"{sec[p]:,.1f}" for p in PHASES),
        _num(r.get("rows_per_s")),
        _num(r["output_tokens_per_s"]),
        _num(r["total_tokens_per_s"]),
        _pct(r["prefix_cache_hit_rate"]),
        _errors(r["errors"]),
    ]


def markdown_table(shards: list[dict[str, Any]], tot: dict[str, Any]) -> list[str]:
    """The per-shard table with a totals row, as markdown lines."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "|".join("---:" for _ in HEADER) + "|"]
    for s in shards:
        rows = f"{s['rows_done']:,}" if s["done"] else f"{s['rows_done']:,} of {s['rows']:,}"
        lines.append("| " + " | ".join(table_row(str(s["shard"]), s, rows)) + " |")
    rows = f"{tot['rows_done']:,}" + ("" if tot["rows_done"] == tot["rows"] else f" of {tot['rows']:,}")
    lines.append("| " + " | ".join(f"**{c}**" for c in table_row("total", tot, rows)) + " |")
    return lines
