"""Throughput figures of a run from its progress/DONE records: per shard, totals, the report table;
and stats.json's shape (merge writes it)."""

from __future__ import annotations

from typing import Any, NotRequired, Optional, TypedDict

from batchinfer.logs import plural
from batchinfer.rundir.progress import (
    PHASES,
    EngineSlot,
    PrefixCache,
    PrefixCacheRecord,
    Progress,
    SecondsRecord,
    SeriesPoint,
    rates,
    read_progress,
)
from batchinfer.rundir.store import RunDir


class Rated(TypedDict):
    """Counts of rows and tokens over seconds by phase, with their rates (progress.Rates)."""

    rows_done: int
    reused_rows: int  # answered from output.reuse, not by the engine
    prompt_tokens: int
    output_tokens: int
    seconds: SecondsRecord
    output_tokens_per_s: Optional[float]
    total_tokens_per_s: Optional[float]
    rows_per_s: Optional[float]
    prefix_cache_hit_rate: Optional[float]
    prefix_cache: Optional[PrefixCacheRecord]
    errors: dict[str, int]


class ShardStats(Rated):
    """One shard's figures in report.json (shard_stats)."""

    shard: int
    done: bool
    rows: int
    attempts: int
    series: list[SeriesPoint]
    device: Optional[str]
    engine: Optional[EngineSlot]  # which of its task's engines ran it (None: a single-engine run)
    adapter_loads: Optional[int]  # LoRA adapters the engine loaded into a slot (None: no adapters)


class Totals(Rated):
    """Sums over a run's shards (totals)."""

    rows: int
    shards: int
    shards_done: int
    adapter_loads: Optional[int]  # over the shards that count them (None: none does)


class PassCounts(TypedDict, total=False):
    """stats.json's record of passes (`batchinfer redo`), absent without passes (splice.Splicer.stats)."""

    passes: dict[str, int]  # pass number (as a JSON key) -> rows of the output
    merged_passes: list[int]


class MergeStats(PassCounts):
    """stats.json, as merge writes it (and returns it)."""

    rows: int
    errors: dict[str, int]
    finish_reasons: dict[str, int]
    prompt_tokens: int
    output_tokens: int
    shards: int
    output: str
    files: list[str]
    seconds: dict[str, float]
    merge_seconds: float
    fingerprint: str
    unchanged: NotRequired[str]  # why merge left the output as it was (splice.unchanged_output)


def shard_record(run: RunDir, index: int) -> tuple[bool, Progress]:
    """(done, the shard's latest record: DONE.json, else progress.json, else an empty one)."""
    folder = run.shard_folder(index)
    done = folder.is_done()
    record = read_progress(folder.done_path if done else folder.progress_path)
    return done, record or Progress(shard=index)


def shard_stats(run: RunDir) -> list[ShardStats]:
    """One row per shard of the plan: rows, tokens, seconds by phase, rates, errors, time series."""
    out = []
    for shard in run.shards():
        done, rec = shard_record(run, shard.index)
        r = rec.rates()
        out.append(
            ShardStats(
                shard=shard.index,
                done=done,
                rows=shard.rows,
                rows_done=rec.rows_done,
                reused_rows=rec.reused_rows,
                prompt_tokens=rec.prompt_tokens,
                output_tokens=rec.output_tokens,
                seconds=SecondsRecord(**{p: getattr(rec.seconds, p) for p in PHASES}),  # type: ignore[typeddict-item]
                output_tokens_per_s=r.output_tokens_per_s,
                total_tokens_per_s=r.total_tokens_per_s,
                rows_per_s=r.rows_per_s,
                prefix_cache_hit_rate=r.prefix_cache_hit_rate,
                prefix_cache=PrefixCacheRecord(queries=rec.prefix_cache.queries, hits=rec.prefix_cache.hits)
                if rec.prefix_cache
                else None,
                errors=rec.errors,
                attempts=rec.attempts,
                series=rec.series,
                device=rec.device,
                engine=rec.engine,
                adapter_loads=rec.adapter_loads,
            )
        )
    return out


def totals(shards: list[ShardStats]) -> Totals:
    """Sums over shards; tok/s is all tokens over all generate seconds (one task's rate while generating)."""
    rows_done, prompt, output = (sum(s[k] for s in shards) for k in ("rows_done", "prompt_tokens", "output_tokens"))
    seconds = SecondsRecord(**{p: sum(s["seconds"][p] for s in shards) for p in PHASES})  # type: ignore[typeddict-item]
    caches = [s["prefix_cache"] for s in shards if s["prefix_cache"]]
    prefix = PrefixCacheRecord(queries=sum(c["queries"] for c in caches), hits=sum(c["hits"] for c in caches))
    errors: dict[str, int] = {}
    for s in shards:
        for kind, n in s["errors"].items():
            errors[kind] = errors.get(kind, 0) + n
    r = rates(prompt, output, rows_done, seconds["generate"], PrefixCache(**prefix) if caches else None)
    loads = [s["adapter_loads"] for s in shards if s.get("adapter_loads") is not None]
    return Totals(
        rows=sum(s["rows"] for s in shards),
        rows_done=rows_done,
        reused_rows=sum(s["reused_rows"] for s in shards),
        prompt_tokens=prompt,
        output_tokens=output,
        seconds=seconds,
        prefix_cache=prefix if caches else None,
        output_tokens_per_s=r.output_tokens_per_s,
        total_tokens_per_s=r.total_tokens_per_s,
        rows_per_s=r.rows_per_s,
        prefix_cache_hit_rate=r.prefix_cache_hit_rate,
        shards=len(shards),
        shards_done=sum(s["done"] for s in shards),
        errors=errors,
        adapter_loads=sum(loads) if loads else None,  # type: ignore[arg-type]
    )


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


def table_row(label: str, r: Rated, rows: str) -> list[str]:
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


def markdown_table(shards: list[ShardStats], tot: Totals) -> list[str]:
    """The per-shard table with a totals row, as markdown lines."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "|".join("---:" for _ in HEADER) + "|"]
    for s in shards:
        rows = f"{s['rows_done']:,}" if s["done"] else f"{s['rows_done']:,} of {s['rows']:,}"
        lines.append("| " + " | ".join(table_row(str(s["shard"]), s, rows)) + " |")
    rows = f"{tot['rows_done']:,}" + ("" if tot["rows_done"] == tot["rows"] else f" of {tot['rows']:,}")
    lines.append("| " + " | ".join(f"**{c}**" for c in table_row("total", tot, rows)) + " |")
    return lines


def reused_line(tot: Totals) -> list[str]:
    """The report's line on rows answered from output.reuse (none without such rows)."""
    n = tot.get("reused_rows") or 0
    if not n:
        return []
    return [
        f"Reused: {n:,} of {tot['rows_done']:,} rows took an earlier run's answer (output.reuse), not the engine.",
        "",
    ]


def summary_line(stats: MergeStats, output: Any, seconds: float) -> str:
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
