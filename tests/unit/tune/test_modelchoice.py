"""Which model forecasts generate seconds (issue 48): the fitted cost of a step where the pilot's
steps support it, else the pilot's rate per computed token; checked on synthetic step logs whose
true cost is known."""

from __future__ import annotations

import math
import random
from array import array
from types import SimpleNamespace
from typing import Any

import pytest

from batchinfer.tune.batching import Limits, Load, Work, steps
from batchinfer.tune.costmodel import CostModel, StepStats, fit, measure_steps
from batchinfer.tune.estimate import estimate, record
from batchinfer.tune.halving import Outcome, Rung
from batchinfer.tune.modelchoice import (
    MIN_FIT_STEPS,
    RATE_MIN_ERROR,
    ForecastModel,
    TokenRate,
    leave_one_out,
    refusals,
    token_rate,
)
from batchinfer.tune.sample import Prompts
from batchinfer.tune.settings import Setting

TRUTH = CostModel(per_step=0.004, per_decode=0.0002, per_prefill=0.00002)


def rung_of(index: int, work: list[Work], limits: Limits, truth: CostModel, noise: float = 0.0, seed: int = 0) -> Rung:
    """A rung whose steps took truth's seconds times a random factor of sd `noise`."""
    rng = random.Random(seed)
    features = list(steps(work, limits.max_num_seqs, limits.max_num_batched_tokens))
    durations = [
        truth.seconds(Load(1, d, p)) * max(0.2, rng.gauss(1.0, noise)) if noise else truth.seconds(Load(1, d, p))
        for d, p in features
    ]
    stats = measure_steps(durations, features, sum(durations))
    stats.requests = len(work)
    outputs = [w.output for w in work]
    r = Rung(index, len(work), sum(w.prompt for w in work), sum(outputs), sum(durations), output_lengths=outputs)
    r.steps, r.limits = stats, limits
    return r


def corpus(rows: int, length: int) -> Prompts:
    """Distinct prompts of `length` tokens sharing no block."""
    return Prompts([f"k{i}" for i in range(rows)], [length] * rows, "tokens", [array("q", [i]) for i in range(rows)])


def config(shards: int) -> Any:
    """What estimate reads of the config: the sharding and the cluster."""
    sh = SimpleNamespace(num_shards=shards, rows_per_shard=None)
    return SimpleNamespace(sharding=sh, cluster=SimpleNamespace(name="local", shards_per_task=1))


def pilot_rungs(
    sizes: list[int], limits: Limits, truth: CostModel, output: int, prompt: int, noise: float
) -> list[Rung]:
    """The pilot's doubling rungs, outputs drawn between 1 and `output`."""
    rng = random.Random(11)
    return [
        rung_of(k, [Work(prompt, rng.randint(1, output)) for _ in range(n)], limits, truth, noise, seed=k)
        for k, n in enumerate(sizes)
    ]


def test_a_fit_on_many_clean_steps_is_used_and_forecasts_the_truth() -> None:
    # the README's default pilot on 256 seats: rungs of 36, 73 and 147 rows run fewer sequences at
    # once than the full run's 1,000-row shards, so the pilot's rate per token is too slow for the
    # full run; the steps' cost carries over, predicts each rung from the others, and is used
    limits = Limits(256, 4096, 32, False)
    rungs = pilot_rungs([36, 73, 147], limits, TRUTH, output=64, prompt=80, noise=0.0)
    lengths = [n for r in rungs for n in r.output_lengths]
    est = estimate(Outcome(Setting(), 5.0, rungs), corpus(2000, 80), config(2), 1, lengths, None, seed=0)
    assert est.kind is ForecastModel.STEP_COST and est.choice is not None and est.choice.refused == ()
    assert est.full is not None and est.model is not None and est.rate is not None
    truth = TRUTH.seconds(est.full.load)
    assert est.model.seconds(est.full.output_mean) == pytest.approx(truth, rel=1e-6)
    assert est.rate.seconds(est.full.load) > 1.1 * truth  # the rate the fallback would have taken
    assert est.choice.fit_loo == pytest.approx(0.0, abs=1e-6) and (est.choice.rate_loo or 0) > 0.05
    kept = record(est)
    assert kept["model"] == "step-cost" and kept["refused"] == []
    assert kept["candidates"]["step-cost"] == pytest.approx(truth, rel=1e-3)
    assert "every rung; the largest sent 147 requests against the full run's 256 at once" in est.note
    assert "tune --rows 446 would fill it" in est.note  # 256 / (147 / 256 pilot rows)


def test_a_fit_on_few_noisy_steps_is_refused_for_the_pilot_rate() -> None:
    # the README example's shape: ~210-token prompts, 2-3 output tokens, a 4,096-token step: the
    # pilot's three rungs take a dozen steps, and on a loaded machine each step's time is noisy
    limits = Limits(256, 4096, 32, False)
    rungs = pilot_rungs([36, 73, 147], limits, TRUTH, output=3, prompt=210, noise=0.3)
    pilot = sum((r.steps for r in rungs if r.steps is not None), StepStats())
    assert pilot.steps < MIN_FIT_STEPS
    lengths = [n for r in rungs for n in r.output_lengths]
    est = estimate(Outcome(Setting(), 5.0, rungs), corpus(722, 210), config(1), 1, lengths, None, seed=0)
    assert est.kind is ForecastModel.PILOT_RATE and est.choice is not None
    assert any(f"{pilot.steps} steps timed" in why for why in est.choice.refused)
    assert est.full is not None and est.model is not None
    # the forecast is the pilot's seconds per computed token times the corpus's computed tokens
    per_token = pilot.generate_seconds / (pilot.decodes + pilot.prefill)
    assert est.model.seconds(est.full.output_mean) == pytest.approx(
        per_token * (est.full.load.decodes + est.full.load.prefill), rel=1e-9
    )
    truth = TRUTH.seconds(est.full.load)
    assert abs(est.model.seconds(est.full.output_mean) / truth - 1) < 0.25
    # the interval widens to the rate's own error: at least RATE_MIN_ERROR, and its leave-one-out error
    assert est.speed_sd >= max(RATE_MIN_ERROR, est.choice.rate_loo or 0.0)
    kept = record(est)
    assert kept["model"] == "pilot-rate" and kept["refused"] == list(est.choice.refused)
    assert set(kept["candidates"]) == {"step-cost", "pilot-rate"}
    assert est.note.startswith(f"{est.full.load.decodes + est.full.load.prefill:,} tokens the engines compute")
    assert "the step cost refused:" in est.note


def test_the_rungs_as_wide_as_the_full_run_are_what_the_models_are_made_on() -> None:
    # 128 seats: the 147-row top rung runs as many sequences at once as the full run; the small
    # rungs' steps cost more (a first window's work: half again the truth) and are left out
    limits = Limits(128, 4096, 32, False)
    slow = CostModel(TRUTH.per_step * 1.5, TRUTH.per_decode * 1.5, TRUTH.per_prefill * 1.5)
    rng = random.Random(2)
    work = [[Work(80, rng.randint(1, 64)) for _ in range(n)] for n in (36, 73, 147)]
    rungs = [rung_of(0, work[0], limits, slow), rung_of(1, work[1], limits, slow), rung_of(2, work[2], limits, TRUTH)]
    lengths = [n for r in rungs for n in r.output_lengths]
    est = estimate(Outcome(Setting(), 5.0, rungs), corpus(722, 80), config(1), 1, lengths, None, seed=0)
    assert est.full is not None and est.full.in_flight == 128 and est.cost is not None
    top = rungs[2].steps
    assert top is not None and top.steps >= MIN_FIT_STEPS
    assert est.cost == fit(top)  # the top rung's steps alone
    assert est.cost.per_decode == pytest.approx(TRUTH.per_decode, rel=1e-6)
    assert est.basis == "the 1 rung(s) of at least 128 requests, as many at once as the full run"
    assert record(est)["fit_on"] == est.basis


def test_refusals_name_each_reason_a_fit_is_not_trusted() -> None:
    pooled = StepStats(steps=200, requests=100, decodes=6400, prefill=8000, generate_seconds=1.0, step_seconds=1.0)
    good = CostModel(0.004, 0.0002, 0.00002)
    assert refusals(good, pooled, 0.05, 0.04, 0.10) == []
    assert refusals(None, pooled, None, None, None) == ["no step cost could be fitted"]
    few = StepStats(steps=14, requests=100, decodes=300, prefill=8000)
    assert refusals(good, few, 0.05, None, None) == [
        f"14 steps timed, fewer than the {MIN_FIT_STEPS} a fit of three costs needs"
    ]
    assert refusals(good, pooled, 0.36, None, None) == ["it misses its own rungs by 36% (more than 20%)"]
    assert refusals(CostModel(0.0, 0.0002, 0.00002), pooled, 0.05, None, None) == [
        "it gives an engine step no cost (its time went to another feature)"
    ]
    assert refusals(CostModel(0.004, 0.0, 0.00002), pooled, 0.05, None, None) == [
        "it gives a decoding sequence no cost though the pilot decoded 6,400 tokens"
    ]
    # a pooling task decodes nothing: no cost on a decoding sequence is right there
    assert refusals(CostModel(0.004, 0.0, 0.00002), StepStats(steps=200, requests=100), 0.05, None, None) == []
    assert refusals(good, pooled, 0.05, 0.30, 0.10) == [
        "predicting each rung from the others it errs by 30%, the pilot's rate by 10%"
    ]


def test_leave_one_out_predicts_each_rung_from_the_others() -> None:
    a = StepStats(steps=1, decodes=100, generate_seconds=1.0)
    b = StepStats(steps=1, decodes=100, generate_seconds=3.0)
    # a from b's rate: 3 s (error +2); b from a's: 1 s (error -2/3)
    assert leave_one_out([a, b], token_rate) == pytest.approx(math.sqrt((4 + 4 / 9) / 2))
    assert leave_one_out([a, a], token_rate) == 0.0
    assert leave_one_out([a], token_rate) is None  # one rung: nothing to hold out
    assert token_rate(a) == TokenRate(0.01) and token_rate(StepStats()) is None


def test_the_tune_prints_and_keeps_which_model_forecast() -> None:
    from batchinfer.tune.results import format_result

    limits = Limits(256, 4096, 32, False)
    rungs = pilot_rungs([36, 73, 147], limits, TRUTH, output=3, prompt=210, noise=0.3)
    lengths = [n for r in rungs for n in r.output_lengths]
    est = estimate(Outcome(Setting(), 5.0, rungs), corpus(722, 210), config(1), 1, lengths, None, seed=0)
    kept = record(est)
    assert [r["requests"] for r in kept["pilot_rungs"]] == [36, 73, 147]
    assert kept["full_run"]["in_flight"] == 256
    fig = {"value": 1.0, "low": 1.0, "high": 1.0}
    result = {
        "sample": {
            "pilot_rows": 256,
            "rows": 722,
            "seed": 0,
            "length_unit": "tokens",
            "pilot_length_p10_p50_p90": [210] * 3,
            "corpus_length_p10_p50_p90": [210] * 3,
            "pilot_duplicate_share": 0.0,
            "corpus_duplicate_share": 0.0,
        },
        "settings": [],
        "output_lengths": {"rows": 256, "mean": 2.0, "p50": 2.0, "p90": 3.0, "share_at_max_tokens": 0.0},
        "best": {"name": "defaults", "overrides": [], "use": "..."},
        "forecast": {
            k: fig
            for k in (
                "prompt_tokens",
                "output_tokens",
                "generate_seconds",
                "engine_starts",
                "gpu_hours",
                "wall_seconds",
            )
        },
        "forecast_model": kept,
    }
    text = format_result(result)
    assert f"  generate hours by pilot-rate: {est.note}; start-up, merge and queueing not included" in text
