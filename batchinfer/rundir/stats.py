"""Throughput figures of a run from its progress/DONE records: per shard, totals, the report table."""

from __future__ import annotations

from typing import Any, Optional

from batchinfer.logs import plural
from batchinfer.rundir.progress import PHASES, PrefixCache, Progress, rates, read_progress
from batchinfer.rundir.store import RunDir


def with_rates(counts: dict[str, Any]) -> dict[str, Any]:
    """Counts (tokens, rows, seconds, prefix cache, as in a progress record) plus their rates (see rates)."""
    cache = counts.get("prefix_cache")
    return dict(
        counts,
        **rates(
            counts.get("prompt_tokens", 0),
            counts.get("output_tokens", 0),
            counts.get("rows_done", 0),
            counts.get("seconds", {}).get("generate", 0.0),
            PrefixCache(cache["queries"], cache["hits"]) if cache else None,
        )._asdict(),
    )


def shard_record(run: RunDir, index: int) -> tuple[bool, Progress]:
    """(done, the shard's latest record: DONE.json, else progress.json, else an empty one)."""
    folder = run.shard_folder(index)
    done = folder.is_done()
    record = read_progress(folder.done_path if done else folder.progress_path)
    return done, record or Progress(shard=index)


def shard_stats(run: RunDir) -> list[dict[str, Any]]:
    """One row per shard of the plan: rows, tokens, seconds by phase, rates, errors, time series."""
    out = []
    for shard in run.shards():
        done, rec = shard_record(run, shard.index)
        out.append(
            {
                "shard": shard.index,
                "done": done,
                "rows": shard.rows,
                "rows_done": rec.rows_done,
                "reused_rows": rec.reused_rows,  # answered from output.reuse, not by the engine
                "prompt_tokens": rec.prompt_tokens,
                "output_tokens": rec.output_tokens,
                "seconds": {p: getattr(rec.seconds, p) for p in PHASES},
                **rec.rates()._asdict(),
                "prefix_cache": {"queries": rec.prefix_cache.queries, "hits": rec.prefix_cache.hits}
                if rec.prefix_cache
                else None,
                "errors": rec.errors,
                "attempts": rec.attempts,
                "series": rec.series,
                "device": rec.device,
                "engine": rec.engine,  # which of its task's engines ran it (None: a single-engine run)
            }
        )
    return out


def totals(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """Sums over shards; tok/s is all tokens over all generate seconds (one task's rate while generating)."""
    keys = ("rows", "rows_done", "reused_rows", "prompt_tokens", "output_tokens")
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


def reused_line(tot: dict[str, Any]) -> list[str]:
    """The report's line on rows answered from output.reuse (none without such rows)."""
    n = tot.get("reused_rows") or 0
    if not n:
        return []
    return [
        f"Reused: {n:,} of {tot['rows_done']:,} rows took an earlier run's answer (output.reuse), not the engine.",
        "",
    ]


def summary_line(stats: dict[str, Any], output: Any, seconds: float) -> str:
    """The one line a finished `run` ends with, from its stats.json: rows, error rows, output tokens
    and their rate while generating, this command's wall time, and where the output is."""
    errors = sum(stats.get("errors", {}).values())
    generate = stats.get("seconds", {}).get("generate", 0.0)
    tokens = stats.get("output_tokens", 0)
    rate = f" at {tokens / generate:,.1f} tok/s" if tokens and generate > 0 else ""
    s = round(seconds)
    wall = f"{s // 60} min {s % 60} s" if s >= 60 else f"{seconds:.1f} s"
    return (
        f"done: {plural(stats.get('rows', 0), 'row')}, {plural(errors, 'error row')}, "
        f"{plural(tokens, 'output token')}{rate}, {wall}; output: {output}"
    )
