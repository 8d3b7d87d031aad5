"""The whole corpus forecast from the pilot and the winning setting: output tokens, generation
seconds, engine starts, GPU-hours, wall time and cost, each with a bootstrap interval over the
pilot's rows (their output lengths; the steady rate is the winner's measured one)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Optional

BOOTSTRAP = 1000
LEVEL = 0.95


@dataclass(frozen=True)
class Figure:
    """A forecast value and its interval."""

    value: float
    low: float
    high: float


@dataclass(frozen=True)
class Layout:
    """How the full run is laid out: from the config and plan's shard arithmetic."""

    rows: int
    array_tasks: int
    engines_per_task: int
    devices_per_engine: int  # GPUs of one engine (TP x PP); 1 on a CPU (an engine's cores as one device)
    array_parallelism: int


@dataclass(frozen=True)
class Measured:
    """What the pilot measured with the winning setting."""

    output_lengths: Sequence[int]  # output tokens of each pilot row
    output_tokens_per_s: float  # steady, start-up excluded; rows/s for a task that generates nothing
    startup_seconds: float
    generates: bool = True


def point(layout: Layout, m: Measured, mean_output: float, price: Optional[float]) -> dict[str, float]:
    """Every forecast figure for one value of the mean output tokens per row."""
    out_tokens = mean_output * layout.rows if m.generates else 0.0
    work = out_tokens if m.generates else float(layout.rows)
    generate = work / m.output_tokens_per_s if m.output_tokens_per_s else math.inf
    starts = layout.array_tasks * layout.engines_per_task
    engine_seconds = generate + starts * m.startup_seconds
    gpu_hours = engine_seconds * layout.devices_per_engine / 3600
    waves = math.ceil(layout.array_tasks / layout.array_parallelism)
    per_task = generate / layout.array_tasks / layout.engines_per_task
    figures = {
        "output_tokens": out_tokens,
        "generate_seconds": generate,
        "engine_starts": float(starts),
        "gpu_hours": gpu_hours,
        "wall_seconds": waves * (m.startup_seconds + per_task),
    }
    if price is not None:
        figures["cost_usd"] = gpu_hours * price
    return figures


def bootstrap(values: Sequence[int], stat: Callable[[float], dict[str, float]], seed: int) -> dict[str, Figure]:
    """Each figure of stat(mean of values) with the percentile interval of BOOTSTRAP resamples."""
    rng = random.Random(seed)
    n = len(values)
    mean = sum(values) / n if n else 0.0
    central = stat(mean)
    draws = [stat(sum(rng.choices(values, k=n)) / n) if n else central for _ in range(BOOTSTRAP)]
    lo_i, hi_i = int((1 - LEVEL) / 2 * BOOTSTRAP), int((1 + LEVEL) / 2 * BOOTSTRAP) - 1
    out = {}
    for key, value in central.items():
        ranked = sorted(d[key] for d in draws)
        out[key] = Figure(value, ranked[lo_i], ranked[hi_i])
    return out


def forecast(layout: Layout, m: Measured, price: Optional[float], seed: int) -> dict[str, Figure]:
    """The forecast of the whole corpus (see the module docstring)."""
    return bootstrap(list(m.output_lengths), lambda mean: point(layout, m, mean, price), seed)


def output_distribution(lengths: Sequence[int], at_max: int) -> dict[str, float]:
    """Mean, p50, p90 of the pilot's output tokens and the share of rows stopped at max_tokens."""
    s = sorted(lengths)
    if not s:
        return {"rows": 0, "mean": 0.0, "p50": 0.0, "p90": 0.0, "share_at_max_tokens": 0.0}
    pick = lambda q: float(s[min(len(s) - 1, int(q * len(s)))])  # noqa: E731
    return {
        "rows": len(s),
        "mean": round(sum(s) / len(s), 2),
        "p50": pick(0.5),
        "p90": pick(0.9),
        "share_at_max_tokens": round(at_max / len(s), 4),
    }


def as_json(figures: dict[str, Figure]) -> dict[str, dict[str, float]]:
    """{"name": {"value", "low", "high"}} rounded for people and scripts."""
    return {k: {n: round(v, 4) for n, v in asdict(f).items()} for k, f in figures.items()}
