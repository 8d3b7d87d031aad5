"""A sample of a corpus's rows spread over it, and what checking it says of the whole corpus."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, TypedDict

from batchinfer.hashing import splitmix64
from batchinfer.insight.findings import Checked


class Sample(Sequence[int]):
    """n rows of total, one in each of n equal stretches, at a place in it the seed picks: spread over
    the whole corpus like evenly spaced rows, but a corpus that repeats with a period (sources
    interleaved, a header every k rows) cannot line up with the spacing. The same rows every time.
    Rows are computed when asked, so a sample of millions is no list of millions (a slice is a list)."""

    def __init__(self, total: int, n: int, seed: int = 0) -> None:
        self.total, self.n, self.seed = total, min(n, total), seed

    def __len__(self) -> int:
        return self.n

    def _row(self, k: int) -> int:
        lo, hi = k * self.total // self.n, (k + 1) * self.total // self.n
        # A hash of k, not a generator's next draw: row k needs no generator state.
        return lo + splitmix64(self.seed * self.total + k) % (hi - lo)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self._row(k) for k in range(*i.indices(self.n))]
        if not -self.n <= i < self.n:
            raise IndexError(i)
        return self._row(i % self.n)


def wilson(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson interval of a proportion seen hits times in n draws (sound at 0 and n, unlike p +- 2 sd)."""
    p, z2 = hits / n, z * z
    centre, half = p + z2 / (2 * n), z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, (centre - half) / (1 + z2 / n)), min(1.0, (centre + half) / (1 + z2 / n))


class Estimate(TypedDict):
    """What a sample says of every row: its counts scaled by total/checked."""

    error_rows: int
    error_rows_95: list[int]  # [low, high]: a 95% range
    error_rows_by_kind: dict[str, int]
    overlong_rows: int
    prompt_tokens_total: int
    would_run: int


class SampleSection(TypedDict):
    """The validate report's `sample`: rows checked, of how many, how spread, and the estimate."""

    rows: int
    of: int
    spread: str
    estimate: Estimate


def sample_section(checked: int, total: int, found: Checked) -> SampleSection:
    """What a sample says of the whole corpus: counts scaled by total/checked, error rows with a 95% range."""
    scale, errors = total / checked, found.errors.total()
    lo, hi = wilson(errors, checked)
    # The sample's own rows are known: at least its error rows, at most every row outside its good ones.
    low, high = max(errors, math.floor(lo * total)), min(total - (checked - errors), math.ceil(hi * total))
    estimate: Estimate = {  # type: ignore[typeddict-item]  # would_run follows
        "error_rows": round(errors * scale),
        "error_rows_95": [low, high],
        "error_rows_by_kind": {k: round(e["count"] * scale) for k, e in found.errors.kinds.items()},
        "overlong_rows": round(found.overlong * scale),
        "prompt_tokens_total": round(sum(v * n for v, n in found.lengths.items()) * scale),
    }
    estimate["would_run"] = total - estimate["error_rows"]
    return {
        "rows": checked,
        "of": total,
        "spread": "one row in each of `rows` equal stretches, picked by seed 0",
        "estimate": estimate,
    }
