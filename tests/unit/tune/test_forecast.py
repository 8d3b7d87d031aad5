"""Forecast arithmetic and its bootstrap interval."""

from __future__ import annotations

import random

import pytest

from batchinfer.tune.forecast import Layout, Measured, as_json, forecast, output_distribution

LAYOUT = Layout(rows=1000, array_tasks=4, engines_per_task=2, devices_per_engine=1, array_parallelism=2)


def test_figures_from_the_pilot_and_the_layout() -> None:
    f = forecast(LAYOUT, Measured([10] * 50, output_tokens_per_s=100.0, startup_seconds=5.0), 2.0, seed=0)
    assert f["output_tokens"].value == 10_000  # 10 tokens a row x 1000 rows
    assert f["generate_seconds"].value == 100.0  # at 100 tok/s on one engine
    assert f["engine_starts"].value == 8  # 4 tasks x 2 engines
    assert f["gpu_hours"].value == pytest.approx((100 + 8 * 5) / 3600)
    # 2 waves of tasks (parallelism 2), each: start-up + its quarter of the work split over 2 engines
    assert f["wall_seconds"].value == pytest.approx(2 * (5 + 100 / 4 / 2))
    assert f["cost_usd"].value == pytest.approx(2.0 * 140 / 3600)
    assert f["output_tokens"].low == f["output_tokens"].high == 10_000  # no spread, no interval


def test_interval_covers_the_spread_of_output_lengths() -> None:
    rng = random.Random(4)
    lengths = [rng.choice([2, 8, 64]) for _ in range(200)]
    f = forecast(LAYOUT, Measured(lengths, 100.0, 5.0), None, seed=1)
    mean = sum(lengths) / len(lengths)
    out = f["output_tokens"]
    assert out.value == pytest.approx(mean * 1000)
    assert out.low < out.value < out.high
    assert out.high - out.low < 0.5 * out.value  # 200 rows pin the mean to within a few tens of percent
    assert f["gpu_hours"].low < f["gpu_hours"].value < f["gpu_hours"].high
    assert "cost_usd" not in f  # no price, no cost
    assert forecast(LAYOUT, Measured(lengths, 100.0, 5.0), None, seed=1) == f  # the seed fixes the interval
    assert set(as_json(f)["wall_seconds"]) == {"value", "low", "high"}


def test_pooling_task_forecasts_rows_per_second() -> None:
    f = forecast(LAYOUT, Measured([0] * 10, 50.0, 5.0, generates=False), None, seed=0)
    assert f["output_tokens"].value == 0 and f["generate_seconds"].value == 1000 / 50


def test_output_distribution() -> None:
    d = output_distribution([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], at_max=3)
    assert d == {"rows": 10, "mean": 5.5, "p50": 6.0, "p90": 10.0, "share_at_max_tokens": 0.3}


def test_prompt_tokens_counted_or_scaled_from_the_pilot() -> None:
    from batchinfer.tune.command import prompt_tokens
    from batchinfer.tune.halving import Outcome, Rung
    from batchinfer.tune.sample import Prompts
    from batchinfer.tune.settings import Setting

    winner = Outcome(Setting(), 1.0, [Rung(0, 10, 300, 50, 1.0), Rung(1, 20, 600, 100, 1.0)])
    counted = Prompts(["a", "b", "c"], [5, 7, 9], "tokens")
    assert prompt_tokens(counted, winner) == {"value": 21, "low": 21, "high": 21}  # every row, as plan counts
    proxy = Prompts(["a"] * 1000, [40] * 1000, "characters")
    assert prompt_tokens(proxy, winner)["value"] == 30 * 1000  # 900 tokens over 30 pilot rows, x 1000 rows
