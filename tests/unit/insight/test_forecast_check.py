"""`report DIR` on a run made with a tune result: the forecast DIR/forecast.json recorded beside the
measured GPU-hours, output tokens, output tok/s and generation seconds, as ratios measured / forecast,
in report.md and in the JSON report."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from support.corpus import write_corpus
from support.runs import model_overrides
from support.standin import StandinEngine
from support.tune_result import make_tune

from batchinfer.config.compose import compose
from batchinfer.insight.forecast_check import compare, forecast_lines
from batchinfer.insight.report import write_report
from batchinfer.launch.local import run_local
from batchinfer.rundir.forecast_record import Figure, RunForecast, write_record
from batchinfer.rundir.store import RunDir
from batchinfer.tune.budget import ForecastOptions, expect


def test_ratios_of_a_partial_run_against_the_forecast_scaled_to_its_rows_done(tmp_path: Path) -> None:
    figures = {
        "gpu_hours": Figure(2.0, 1.5, 2.5),
        "output_tokens": Figure(1000.0, 900.0, 1100.0),
        "generate_seconds": Figure(100.0, 90.0, 110.0),
        "output_tokens_per_s": Figure(10.0, 10.0, 10.0),
        "wall_seconds": Figure(7.0, 7.0, 7.0),  # not compared: the run dir does not know its wall time
    }
    rf = RunForecast("/t/tune.json", "f" * 64, "2026-12-03", "s", [], True, 100, {}, None, None, figures)
    write_record(tmp_path, rf)
    tot = {"rows": 100, "rows_done": 50, "output_tokens": 600, "seconds": {"generate": 40.0}}
    fc = compare(RunDir(tmp_path), tot, {"gpu_hours": 1.25})
    assert fc is not None and fc["scaled_to_rows_done"] == 0.5 and fc["source"] == "/t/tune.json"
    got = {
        k: (v["value"], v["low"], v["high"], v["measured"], v["ratio"], v["within"]) for k, v in fc["figures"].items()
    }
    assert got == {
        "gpu_hours": (1.0, 0.75, 1.25, 1.25, 1.25, True),
        "output_tokens": (500.0, 450.0, 550.0, 600.0, 1.2, False),
        "output_tokens_per_s": (10.0, 10.0, 10.0, 15.0, 1.5, False),  # a rate: not scaled
        "generate_seconds": (50.0, 45.0, 55.0, 40.0, 0.8, False),
    }
    text = "\n".join(forecast_lines(fc))
    assert "| output tokens | 500 | 450 .. 550 | 600 | 1.20 |" in text
    assert "| GPU-hours | 1 | 0.75 .. 1.25 | 1.25 | 1.25 |" in text and "Partial run" in text
    assert compare(RunDir(tmp_path / "none"), tot, {"gpu_hours": 1.0}) is None  # no forecast.json: no section


def test_a_run_with_a_tune_result_reports_forecast_and_measured(
    tmp_path: Path, tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    write_corpus(tmp_path / "in.jsonl", 24)
    model = [o for o in model_overrides(tiny_model_path) if not o.startswith("model.max_num_seqs=")]
    base = [f"input.path={tmp_path / 'in.jsonl'}", "input.id_column=id", *model, "sampling.max_tokens=6"]
    make_tune(tmp_path / "tune", base)
    conf = ["+tuned=best"]
    cfg = compose([*base, *conf, f"output.dir={tmp_path / 'run'}"], config_dir=str(tmp_path / "tune" / "conf"))
    opts = ForecastOptions("run", [*base, *conf], config_dir=str(tmp_path / "tune" / "conf"))
    run = run_local(cfg, engine=StandinEngine(cfg), prepared=lambda r: expect(r, opts))
    recorded = json.loads((run.path / "forecast.json").read_text())
    assert recorded["source"] == str(tmp_path / "tune" / "tune.json") and recorded["tuned_settings_used"]

    rep, text = write_report(RunDir(run.path))
    fc = rep["forecast"]
    out_tokens = sum(pq.read_table(run.output_path).column("output_tokens").to_pylist())
    gen = rep["totals"]["seconds"]["generate"]
    measured = {
        "gpu_hours": rep["cost"]["gpu_hours"],
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / gen,
        "generate_seconds": gen,
    }
    assert set(fc["figures"]) == set(measured) and fc["scaled_to_rows_done"] == 1.0
    for name, value in measured.items():
        f = fc["figures"][name]
        assert f["measured"] == pytest.approx(value)
        assert f["value"] == recorded["figures"][name]["value"] and f["ratio"] == pytest.approx(value / f["value"])
    assert "## Forecast and measured" in text and str(tmp_path / "tune" / "tune.json") in text
    assert f"| output tokens | {recorded['figures']['output_tokens']['value']:,.4g} |" in text
    assert json.loads((run.path / "report" / "report.json").read_text())["forecast"] == fc
