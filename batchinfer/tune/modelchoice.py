"""Which model forecasts the full run's generate seconds: the fitted cost of an engine step
(tune/costmodel.py) where the pilot's steps support it, else the pilot's rate per token the engine
computes, scaled to the corpus's tokens (its duplicates, prefix-cache hits and output tokens, all
counted exactly on the login node: tune/fullrun.py).

A fit of three costs on few steps, or on a loaded machine, can trade one cost for another and
still explain the pilot (measured: 14-20 steps in the README example's pilot forecast 1.2-1.4x;
a 36% fit error with no cost left on a decoding sequence forecast 0.45x). So the fit is refused
when it has too few steps, explains its own rungs badly, gives a step or a decoding sequence no
cost, or predicts each rung from the others worse than the pilot's rate does (leave one rung out).
The interval then widens to the chosen model's own error."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Optional, Protocol

from batchinfer.tune.batching import Load
from batchinfer.tune.costmodel import CostModel, StepStats, fit, relative_error

# Steps a fit of three costs needs (ten a cost): the README example's 14-20 are too few.
MIN_FIT_STEPS = 30
# A fit that misses its own rungs' generate seconds by more than this (root mean square) is noise.
MAX_FIT_ERROR = 0.20
# The least error the rate model is given: the pilot's rate per computed token forecast 0.87-1.29x
# of the full run over five measured runs on a loaded 2-core machine (benchmarks/results/
# tune_forecast_ratio.md, 2026-12-06), a spread of about 15%.
RATE_MIN_ERROR = 0.15


class ForecastModel(str, Enum):
    """How the forecast's generate seconds were made (tune.json's forecast_model.model)."""

    STEP_COST = "step-cost"  # the fitted cost of a step times the full run's replayed steps
    PILOT_RATE = "pilot-rate"  # the pilot's seconds per computed token times the full run's tokens
    MEASURED_RATE = "measured-rate"  # no step timings: the setting's measured output tokens per second


class Predictor(Protocol):
    """A model of generate seconds from a run's engine totals."""

    def seconds(self, load: Load) -> float: ...


@dataclass(frozen=True)
class TokenRate:
    """Generate seconds per token the engine computes (one per decoding sequence and step, one per
    prompt token not served from the prefix cache): the pilot's rate, start-up excluded."""

    seconds_per_token: float

    def seconds(self, load: Load) -> float:
        """Generate seconds of a run with these totals."""
        return self.seconds_per_token * (load.decodes + load.prefill)


def token_rate(s: StepStats) -> Optional[TokenRate]:
    """The rate of the rungs pooled in s; None without generate seconds or tokens."""
    tokens = s.decodes + s.prefill
    if s.generate_seconds <= 0 or tokens <= 0:
        return None
    return TokenRate(s.generate_seconds / tokens)


def leave_one_out(rungs: Sequence[StepStats], make: Callable[[StepStats], Optional[Predictor]]) -> Optional[float]:
    """Root mean square relative error of each rung's generate seconds predicted by a model made from
    the other rungs pooled: how well the model carries to a run it was not made on (the forecast's
    own task). None with fewer than two rungs."""
    timed = [r for r in rungs if r.generate_seconds > 0]
    if len(timed) < 2:
        return None
    errs = []
    for k, held in enumerate(timed):
        others = [r for i, r in enumerate(timed) if i != k]
        model = make(sum(others[1:], others[0]))
        if model is None:
            return None
        errs.append((model.seconds(held.load) - held.generate_seconds) / held.generate_seconds)
    return math.sqrt(sum(e * e for e in errs) / len(errs))


@dataclass(frozen=True)
class Choice:
    """The model chosen, why the step cost was refused (empty: used), and the errors measured."""

    model: ForecastModel
    refused: tuple[str, ...]
    fit_error: Optional[float]  # the step cost's error on the rungs it was fitted on
    fit_loo: Optional[float]  # leave one rung out, the step cost
    rate_loo: Optional[float]  # leave one rung out, the pilot's rate
    error: float  # the chosen model's relative error: the interval widens to it


def refusals(
    cost: Optional[CostModel],
    pooled: StepStats,
    fit_error: Optional[float],
    fit_loo: Optional[float],
    rate_loo: Optional[float],
) -> list[str]:
    """Why the step cost must not forecast (empty: it may)."""
    if cost is None:
        return ["no step cost could be fitted"]
    why = []
    if pooled.steps < MIN_FIT_STEPS:
        why.append(f"{pooled.steps} steps timed, fewer than the {MIN_FIT_STEPS} a fit of three costs needs")
    if fit_error is not None and fit_error > MAX_FIT_ERROR:
        why.append(f"it misses its own rungs by {fit_error:.0%} (more than {MAX_FIT_ERROR:.0%})")
    if cost.per_step <= 0:
        why.append("it gives an engine step no cost (its time went to another feature)")
    if cost.per_decode <= 0 and pooled.decodes > pooled.requests:
        why.append(f"it gives a decoding sequence no cost though the pilot decoded {pooled.decodes:,} tokens")
    if fit_loo is not None and rate_loo is not None and fit_loo > rate_loo:
        why.append(f"predicting each rung from the others it errs by {fit_loo:.0%}, the pilot's rate by {rate_loo:.0%}")
    return why


def choose(
    rungs: Sequence[StepStats], basis: Sequence[StepStats]
) -> tuple[Choice, Optional[CostModel], Optional[TokenRate]]:
    """The model of the forecast from every timed rung (the leave-one-out check) and the basis rungs
    (those the models are made on: the rungs that fill the full run's batch where any does); with
    the step cost and the rate made on the basis."""
    pooled = sum(basis[1:], basis[0])
    cost, rate = fit(pooled), token_rate(pooled)
    fit_error = relative_error(cost, basis) if cost is not None else None
    fit_loo = leave_one_out(rungs, fit)
    rate_loo = leave_one_out(rungs, token_rate)
    why = refusals(cost, pooled, fit_error, fit_loo, rate_loo)
    if not why:
        error = max(fit_error or 0.0, fit_loo or 0.0)
        return Choice(ForecastModel.STEP_COST, (), fit_error, fit_loo, rate_loo, error), cost, rate
    error = max(RATE_MIN_ERROR, rate_loo or 0.0)
    return Choice(ForecastModel.PILOT_RATE, tuple(why), fit_error, fit_loo, rate_loo, error), cost, rate
