"""The full run's generate seconds for the winner: its cost of an engine step, fitted on every step
of its rungs and repeats (tune/costmodel.py), times the work the whole corpus gives its engines,
counted and replayed on the login node (tune/fullrun.py); with the noise of that estimate, which
the forecast's interval carries. Without step timings (a setting of several engines, each in its
own process) there is no model: the forecast takes the measured rate."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Optional

from batchinfer.tune.costmodel import CostModel, StepStats, fit, relative_error
from batchinfer.tune.forecast import GenerateModel
from batchinfer.tune.fullrun import FullRun, full_run
from batchinfer.tune.halving import Outcome
from batchinfer.tune.sample import Prompts

# The least noise an estimate of speed is given, relative (a tune whose measurements happened to
# agree has not shown that the machine is steady).
MIN_SPEED_SD = 0.05


@dataclass(frozen=True)
class Estimate:
    """How the forecast's generate seconds were made."""

    model: Optional[GenerateModel]
    cost: Optional[CostModel]
    full: Optional[FullRun]
    pilot: Optional[StepStats]  # the winner's steps, every rung and repeat together
    fit_error: Optional[float]  # root mean square relative error of the cost model over those rungs
    speed_sd: float  # relative standard deviation of the speed, the interval's noise
    note: str  # how, or why not


def speed_sd(noise: Optional[float], fit_error: Optional[float]) -> float:
    """The speed's relative standard deviation: the larger of the tune's noise (the spread of two
    measurements of one setting is sqrt(2) standard deviations) and the fit's error, at least
    MIN_SPEED_SD."""
    return max(MIN_SPEED_SD, (noise or 0.0) / math.sqrt(2), fit_error or 0.0)


def shard_ranges(c: Any, rows: int) -> list[tuple[int, int]]:
    """[start, stop) of every shard of the full run, as plan counts them."""
    from batchinfer.config.schema import DEFAULT_ROWS_PER_SHARD
    from batchinfer.inputs.shards import plan_shards

    sh = c.sharding
    return [(s.start, s.stop) for s in plan_shards(rows, sh.num_shards, sh.rows_per_shard, DEFAULT_ROWS_PER_SHARD)]


def shards_per_engine(c: Any, engines: int) -> Optional[int]:
    """How many consecutive shards one engine runs (its prefix cache carries over between them):
    all of them in a local run of one engine (None), an array task's under Slurm, one each where
    a task's engines take shards one at a time."""
    if engines > 1:
        return 1
    return None if c.cluster.name == "local" else int(c.cluster.shards_per_task)


def estimate(
    winner: Outcome,
    prompts: Prompts,
    c: Any,
    engines: int,
    output_lengths: list[int],
    noise: Optional[float],
    seed: int,
) -> Estimate:
    """The winner's generate-seconds model of the full run of config c (its layout: engines per
    task, shards), or why there is none."""
    rungs = [r for r in [*winner.rungs, *winner.repeats] if r.steps is not None]
    limits = next((r.limits for r in rungs if r.limits is not None), None)
    if not rungs or limits is None:
        why = "no step timings (a setting of several engines per task): from its measured rate"
        return Estimate(None, None, None, None, None, speed_sd(noise, None), why)
    steps = [r.steps for r in rungs if r.steps is not None]
    pilot = sum(steps[1:], steps[0])
    cost = fit(pilot)
    if cost is None:
        return Estimate(None, None, None, pilot, None, speed_sd(noise, None), "no step measured: from the rate")
    error = relative_error(cost, steps)
    per_request = pilot.prefill / pilot.requests if pilot.requests else None
    full = full_run(
        prompts,
        shard_ranges(c, len(prompts.keys)),
        shards_per_engine(c, engines),
        limits,
        output_lengths,
        seed,
        prompt_per_request=per_request,
    )
    prefill = cost.overhead * cost.per_prefill * full.load.prefill
    model = GenerateModel(prefill, cost.seconds(full.load) - prefill, full.output_mean)
    note = (
        f"{full.load.steps:,} engine steps of up to {limits.max_num_seqs} sequences and "
        f"{limits.max_num_batched_tokens:,} tokens, replayed from the whole corpus: {full.requests:,} requests "
        f"({full.duplicate_share:.1%} of rows repeat one in their shard), {full.prefix_share:.1%} of their "
        f"prompt tokens from the prefix cache; x the winner's cost of a step"
    )
    return Estimate(model, cost, full, pilot, error, speed_sd(noise, error), note)


def record(e: Estimate) -> dict[str, Any]:
    """The estimate as tune.json keeps it."""
    out: dict[str, Any] = {"note": e.note, "speed_sd": round(e.speed_sd, 4)}
    if e.cost is not None:
        out["step_cost"] = {k: round(v, 9) for k, v in asdict(e.cost).items()}
        out["fit_error"] = round(e.fit_error or 0.0, 4)
    if e.pilot is not None:
        p = e.pilot
        out["pilot"] = {
            "steps": p.steps,
            "replayed_steps": p.replayed,
            "requests": p.requests,
            "decodes": p.decodes,
            "prefill_tokens": p.prefill,
            "generate_seconds": round(p.generate_seconds, 3),
        }
    if e.full is not None:
        f = e.full
        out["full_run"] = {
            "steps": f.load.steps,
            "decodes": f.load.decodes,
            "prefill_tokens": f.load.prefill,
            "requests": f.requests,
            "duplicate_share": round(f.duplicate_share, 4),
            "prompt_tokens_sent": f.prompt_tokens,
            "prefix_cache_share": round(f.prefix_share, 4),
            "output_mean": round(f.output_mean, 2),
        }
    return out
