"""The shard plan: contiguous row ranges, by count or by size."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


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
