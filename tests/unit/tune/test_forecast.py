"""Forecast arithmetic and its bootstrap interval."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from support.runs import model_overrides

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


def test_a_pilot_of_the_whole_corpus_measured_its_output_tokens() -> None:
    """Every row ran: the output tokens are the pilot's sum, no interval; the speed's noise still
    widens the time figures."""
    whole = Layout(rows=5, array_tasks=1, engines_per_task=1, devices_per_engine=1, array_parallelism=1)
    lengths = [2, 30, 7, 19, 12]
    f = forecast(whole, Measured(lengths, 100.0, 5.0, speed_sd=0.2, whole_corpus=True), None, seed=0)
    assert (f["output_tokens"].low, f["output_tokens"].value, f["output_tokens"].high) == pytest.approx((70, 70, 70))
    assert f["generate_seconds"].low < f["generate_seconds"].value < f["generate_seconds"].high
    sampled = forecast(whole, Measured(lengths, 100.0, 5.0, speed_sd=0.2), None, seed=0)
    assert sampled["output_tokens"].low < 70 < sampled["output_tokens"].high  # a sample of a larger corpus


def test_tune_of_a_corpus_smaller_than_the_pilot_says_its_output_tokens_are_measured(
    tmp_path: Path, tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """attack M5: `tune --rows 24` of a 5-row corpus forecast output_tokens 14 (9..19)."""
    from batchinfer.config.compose import compose
    from batchinfer.tune import command
    from batchinfer.tune.halving import Outcome, Rung

    lengths = [1, 2, 3, 4, 6]

    def every_row_once(settings: list[Any], rungs: int, launch: Any, budget: float, say: Any = print) -> list[Outcome]:
        launch(settings[0])
        return [Outcome(settings[0], 3.5, [Rung(0, 5, 61, sum(lengths), 1.0, output_lengths=lengths)])]

    monkeypatch.setattr(command, "halve", every_row_once)
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"id": f"r{i}", "text": f"hello {i} " * (1 + i)}) + "\n" for i in range(5)))
    cfg = compose([f"input.path={data}", "input.id_column=id", *model_overrides(tiny_model_path)])
    result = command.tune(cfg, command.Options([], rows=24, tries=["defaults"], out=str(tmp_path / "T")))
    assert result["forecast"]["output_tokens"] == {"value": 16, "low": 16, "high": 16}
    assert result["sample"]["pilot_rows"] == 5 and result["sample"]["pilot_is_corpus"] is True
    md = (tmp_path / "T" / "tune.md").read_text()
    (line,) = [x for x in md.splitlines() if x.startswith("  output tokens ")]
    assert line.split() == [
        "output",
        "tokens",
        "16",
        "(16",
        "..",
        "16)",
        "measured:",
        "the",
        "pilot",
        "ran",
        "the",
        "whole",
        "corpus",
    ]
