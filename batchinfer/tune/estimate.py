"""The full run's generate seconds for the winner: its cost of an engine step, fitted on the steps of
its rungs and repeats (tune/costmodel.py), times the work the whole corpus gives its engines,
counted and replayed on the login node (tune/fullrun.py); or, where the pilot's steps do not
support that fit, the pilot's seconds per computed token times the corpus's tokens (the choice:
tune/modelchoice.py). The models are made on the rungs as wide as the full run (as many sequences
at once) where any is. The estimate's noise, which the forecast's interval carries, is the larger
of the tune's and the chosen model's error. Without step timings (a setting of several engines,
each in its own process) there is no model: the forecast takes the measured rate."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Optional

from batchinfer.tune.costmodel import CostModel, StepStats
from batchinfer.tune.forecast import GenerateModel
from batchinfer.tune.fullrun import FullRun, full_run
from batchinfer.tune.halving import Outcome
from batchinfer.tune.modelchoice import Choice, ForecastModel, TokenRate, choose
from batchinfer.tune.sample import Prompts

# The least noise an estimate of speed is given, relative (a tune whose measurements happened to
# agree has not shown that the machine is steady).
MIN_SPEED_SD = 0.05


@dataclass(frozen=True)
class Estimate:
    """How the forecast's generate seconds were made."""

    kind: ForecastModel
    model: Optional[GenerateModel]
    cost: Optional[CostModel]
    full: Optional[FullRun]
    pilot: Optional[StepStats]  # the winner's steps, every rung and repeat together
    fit_error: Optional[float]  # root mean square relative error of the cost model over its rungs
    speed_sd: float  # relative standard deviation of the speed, the interval's noise
    note: str  # how, or why not
    choice: Optional[Choice] = None  # step cost or pilot rate, and why
    rate: Optional[TokenRate] = None
    basis: str = ""  # the rungs the models were made on
    rungs: tuple[StepStats, ...] = ()  # each timed rung and repeat, in order


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
    measured = ForecastModel.MEASURED_RATE
    if not rungs or limits is None:
        why = "no step timings (a setting of several engines per task): from its measured rate"
        return Estimate(measured, None, None, None, None, None, speed_sd(noise, None), why)
    steps = [r.steps for r in rungs if r.steps is not None]
    pilot = sum(steps[1:], steps[0])
    if pilot.steps == 0 or pilot.step_seconds <= 0:
        return Estimate(
            measured, None, None, pilot, None, None, speed_sd(noise, None), "no step measured: from the rate"
        )
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
    basis, basis_note = fill_basis(steps, full, winner)
    choice, cost, rate = choose(steps, basis)
    sd = speed_sd(noise, choice.error)
    work = (
        f"replayed from the whole corpus: {full.requests:,} requests ({full.duplicate_share:.1%} of rows repeat one in "
        f"their shard), {full.prefix_share:.1%} of their prompt tokens from the prefix cache"
    )
    if choice.model is ForecastModel.STEP_COST and cost is not None:
        prefill = cost.overhead * cost.per_prefill * full.load.prefill
        model = GenerateModel(prefill, cost.seconds(full.load) - prefill, full.output_mean)
        note = (
            f"{full.load.steps:,} engine steps of up to {limits.max_num_seqs} sequences and "
            f"{limits.max_num_batched_tokens:,} tokens, {work}; x the winner's cost of a step ({basis_note})"
        )
    elif rate is not None:
        spt = rate.seconds_per_token
        model = GenerateModel(spt * full.load.prefill, spt * full.load.decodes, full.output_mean)
        note = (
            f"{full.load.decodes + full.load.prefill:,} tokens the engines compute ({full.load.decodes:,} "
            f"decoded, {full.load.prefill:,} of prompts), {work}; x the pilot's seconds per token ({basis_note}); "
            f"the step cost refused: {'; '.join(choice.refused)}"
        )
    else:
        return Estimate(
            measured, None, cost, full, pilot, choice.fit_error, sd, "no tokens timed: from the rate", choice
        )
    return Estimate(
        choice.model, model, cost, full, pilot, choice.fit_error, sd, note, choice, rate, basis_note, tuple(steps)
    )


def fill_basis(steps: list[StepStats], full: FullRun, winner: Outcome) -> tuple[list[StepStats], str]:
    """The rungs the models are made on: those as wide as the full run (as many sequences at once)
    where any is, else all of them, the pilot under-filling the batch (its note says by how much
    and what --rows would fill it)."""
    wide = [s for s in steps if full.filled_by(s.requests)]
    if wide and len(wide) < len(steps):
        return wide, f"the {len(wide)} rung(s) of at least {full.in_flight} requests, as many at once as the full run"
    if wide:
        return steps, f"every rung, each of at least {full.in_flight} requests"
    top = max(s.requests for s in steps)
    pilot_rows = sum(r.rows for r in winner.rungs)
    share = top / pilot_rows if pilot_rows else 1.0
    rows = math.ceil(full.in_flight / share) if share > 0 else full.in_flight
    return steps, (
        f"every rung; the largest sent {top} requests against the full run's {full.in_flight} at once: "
        f"the pilot under-fills the batch (tune --rows {rows} would fill it)"
    )


def _rounded(v: Optional[float]) -> Optional[float]:
    return round(v, 4) if v is not None else None


def record(e: Estimate) -> dict[str, Any]:
    """The estimate as tune.json keeps it."""
    out: dict[str, Any] = {"model": e.kind.value, "note": e.note, "speed_sd": round(e.speed_sd, 4)}
    if e.choice is not None:
        ch = e.choice
        out["refused"] = list(ch.refused)  # why the step cost was not used; empty: it was
        out["leave_one_out_error"] = {
            ForecastModel.STEP_COST.value: _rounded(ch.fit_loo),
            ForecastModel.PILOT_RATE.value: _rounded(ch.rate_loo),
        }
        out["fit_on"] = e.basis
    if e.full is not None:
        # both models' generate seconds of the full run (at the replay's output mean): the one not
        # chosen is kept for comparing against the measured run (benchmarks/tune_forecast.py)
        candidates = {}
        if e.cost is not None:
            candidates[ForecastModel.STEP_COST.value] = round(e.cost.seconds(e.full.load), 3)
        if e.rate is not None:
            candidates[ForecastModel.PILOT_RATE.value] = round(e.rate.seconds(e.full.load), 3)
        out["candidates"] = candidates
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
        # each rung's totals (the rungs and the repeats, in order): what the leave-one-out check used
        out["pilot_rungs"] = [
            {
                "requests": r.requests,
                "steps": r.steps,
                "decodes": r.decodes,
                "prefill_tokens": r.prefill,
                "generate_seconds": round(r.generate_seconds, 4),
            }
            for r in e.rungs
        ]
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
            "in_flight": f.in_flight,
        }
    return out
