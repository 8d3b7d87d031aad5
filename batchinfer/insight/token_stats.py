"""Prompt token lengths summed up: nearest-rank percentiles, a histogram, min/mean/max/total."""

from __future__ import annotations

import math
from collections import Counter
from typing import TypedDict

# A histogram bin: rows whose prompt has from..to tokens (inclusive).
Bin = TypedDict("Bin", {"from": int, "to": int, "rows": int})


def percentile(counts: Counter[int], q: float) -> int:
    """Nearest-rank percentile of values given as value -> how many times."""
    rank, seen = max(1, math.ceil(q * sum(counts.values()))), 0
    for value in sorted(counts):
        seen += counts[value]
        if seen >= rank:
            return value
    raise ValueError("no values")


def histogram(counts: Counter[int], bins: int = 10) -> list[Bin]:
    """Rows per equal-width bin of token lengths up to p99, [from, to] inclusive; the rare longer
    prompts share one last bin, so that one outlier does not squeeze every other row into one bar."""
    lo, hi, top = min(counts), percentile(counts, 0.99), max(counts)
    width = max(1, math.ceil((hi - lo + 1) / (bins - 1 if top > hi else bins)))
    out: list[Bin] = [{"from": a, "to": min(a + width - 1, hi), "rows": 0} for a in range(lo, hi + 1, width)]
    if top > hi:
        out.append({"from": hi + 1, "to": top, "rows": 0})
    for value, n in counts.items():
        out[len(out) - 1 if value > hi else (value - lo) // width]["rows"] += n
    return out


class TokenStats(TypedDict, total=False):
    """Prompt token lengths in the validate report: only `rows` when there are none."""

    rows: int
    min: int
    p50: int
    p90: int
    p99: int
    max: int
    mean: float
    total: int
    histogram: list[Bin]


def token_stats(counts: Counter[int]) -> TokenStats:
    """min, p50, p90, p99, max, mean, total and a histogram of prompt token lengths."""
    if not counts:
        return {"rows": 0}
    rows = sum(counts.values())
    total = sum(v * n for v, n in counts.items())
    stats: TokenStats = {"rows": rows, "min": min(counts)}
    stats |= {f"p{round(q * 100)}": percentile(counts, q) for q in (0.5, 0.9, 0.99)}
    return stats | {"max": max(counts), "mean": round(total / rows, 1), "total": total, "histogram": histogram(counts)}
