"""The whole corpus forecast from the pilot and the winning setting: output tokens, generation
seconds, engine starts, GPU-hours, wall time and cost, each with a bootstrap interval over the
pilot's rows (their output lengths) and the noise of the measured speed. Generation seconds come
from the winner's cost of an engine step applied to the full run's steps, replayed from the whole
corpus (GenerateModel: tune/costmodel.py, tune/fullrun.py); without step timings (a setting of
several engines) from its measured rate."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Optional

from batchinfer.rundir.forecast_record import Figure

BOOTSTRAP = 1000
LEVEL = 0.95


@dataclass(frozen=True)
class Layout:
    """How the full run is laid out: from the config and plan's shard arithmetic."""

    rows: int
    array_tasks: int
    engines_per_task: int
    devices_per_engine: int  # GPUs of one engine (TP x PP); 1 on a CPU (an engine's cores as one device)
    array_parallelism: int


@dataclass(frozen=True)
class GenerateModel:
    """The full run's generate seconds (engine-seconds, every shard) from the winner's cost of a
    step and the corpus's engine work, split into the part of the prompt tokens computed and the
    rest (steps and decodes), which grows with the mean output tokens per request."""

    prefill_seconds: float
    other_seconds: float
    output_mean: float  # the mean output tokens per request the replay drew

    def seconds(self, mean_output: float) -> float:
        """Generate seconds when the mean output per row is mean_output instead."""
        k = mean_output / self.output_mean if self.output_mean > 0 else 1.0
        return self.prefill_seconds + self.other_seconds * k


@dataclass(frozen=True)
class Measured:
    """What the pilot measured with the winning setting."""

    output_lengths: Sequence[int]  # output tokens of each pilot row
    output_tokens_per_s: float  # steady, start-up excluded; rows/s for a task that generates nothing
    startup_seconds: float
    generates: bool = True
    model: Optional[GenerateModel] = None  # generate seconds from the corpus; None: from the rate
    speed_sd: float = 0.0  # relative standard deviation of the measured speed (the tune's noise)
    whole_corpus: bool = False  # the pilot ran every row of the corpus: its output lengths are the run's


def point(
    layout: Layout, m: Measured, mean_output: float, price: Optional[float], speed: float = 1.0
) -> dict[str, float]:
    """Every forecast figure for one value of the mean output tokens per row, at `speed` times the
    measured speed."""
    out_tokens = mean_output * layout.rows if m.generates else 0.0
    work = out_tokens if m.generates else float(layout.rows)
    if m.model is not None:
        generate = m.model.seconds(mean_output) / speed
    else:
        generate = work / (m.output_tokens_per_s * speed) if m.output_tokens_per_s else math.inf
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


def bootstrap(
    values: Sequence[int],
    stat: Callable[[float, float], dict[str, float]],
    seed: int,
    speed_sd: float = 0.0,
    resample: bool = True,
) -> dict[str, Figure]:
    """Each figure of stat(mean of values, speed 1) with the percentile interval of BOOTSTRAP draws,
    each a resample of values (resample=False: values are the population, their mean every draw's)
    and a speed drawn around 1 with standard deviation speed_sd."""
    rng = random.Random(seed)
    n = len(values)
    mean = sum(values) / n if n else 0.0
    central = stat(mean, 1.0)
    draws = []
    for _ in range(BOOTSTRAP):
        resampled = sum(rng.choices(values, k=n)) / n if n and resample else mean
        speed = max(0.2, rng.gauss(1.0, speed_sd)) if speed_sd > 0 else 1.0
        draws.append(stat(resampled, speed))
    lo_i, hi_i = int((1 - LEVEL) / 2 * BOOTSTRAP), int((1 + LEVEL) / 2 * BOOTSTRAP) - 1
    out = {}
    for key, value in central.items():
        ranked = sorted(d[key] for d in draws)
        out[key] = Figure(value, ranked[lo_i], ranked[hi_i])
    return out


def forecast(layout: Layout, m: Measured, price: Optional[float], seed: int) -> dict[str, Figure]:
    """The forecast of the whole corpus (see the module docstring). A pilot that ran the whole corpus
    measured its output tokens: only the speed's noise is left to widen an interval."""
    return bootstrap(
        list(m.output_lengths),
        lambda mean, speed: point(layout, m, mean, price, speed),
        seed,
        m.speed_sd,
        resample=not m.whole_corpus,
    )


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
