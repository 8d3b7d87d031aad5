"""`batchinfer tune` on the real engine, two settings and at most two engine starts: one that vLLM
refuses (a row with vLLM's reason, not a crash) and the config as composed, which runs the pilot
in its trial process rung after rung on one engine and wins; the tune folder and --json say so;
then `submit` with its group and a budget under its forecast is refused before any sbatch."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf
from support.corpus import write_corpus
from support.procs import run_cli
from support.runs import model_overrides

REFUSED = "model.max_num_seqs=8 model.max_num_batched_tokens=4"  # vLLM: batched tokens below max_num_seqs


def test_tune_reports_a_refused_setting_runs_the_other_and_forecasts(tmp_path: Path, tiny_model_path: Path) -> None:
    corpus = tmp_path / "in.jsonl"
    rows = write_corpus(corpus, 60, seed=3)
    out = tmp_path / "tune"
    args = [f"input.path={corpus}", "input.id_column=id", "sampling.max_tokens=6", *model_overrides(tiny_model_path)]
    res = run_cli(
        ["tune", *args, "--rows", "24", "--try", REFUSED, "--try", "defaults", "--out", str(out), "--json"],
        timeout=900,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(res.stdout)
    refused, default = result["settings"]
    assert refused["overrides"] == REFUSED.split()
    # refused by batchinfer's config check in the trial, before its engine starts (vLLM would refuse it there)
    assert "max_num_batched_tokens=4 is below model.max_num_seqs=8" in refused["failure"] and refused["rows"] == 0
    # the config as composed: started once, then both rungs (8 + 16 rows) on that engine
    assert default["failure"] is None and default["overrides"] == []
    assert default["startup_seconds"] > 0 and default["rungs"] == 2 and default["rows"] == 24
    assert default["output_tokens_per_s"] > 0 and default["peak_memory_mb"] > 0
    (log_path,) = (out / "trials").glob("*/01/trial.log")  # this tune's own trial folder
    log = log_path.read_text()
    assert log.count("tune trial: engine ready") == 1 and "starting vLLM engine" not in log  # no rung built one
    assert result["best"] == {
        "name": "defaults",
        "overrides": [],
        "config_group": str(out / "conf" / "tuned" / "best.yaml"),
        "use": f"--config-dir {out / 'conf'} +tuned=best",
    }
    # The tiny model never stops by itself: every pilot row ran to max_tokens.
    assert result["output_lengths"] == {"rows": 24, "mean": 6.0, "p50": 6.0, "p90": 6.0, "share_at_max_tokens": 1.0}
    fc = result["forecast"]
    assert fc["output_tokens"] == {"value": 360.0, "low": 360.0, "high": 360.0}  # 6 tokens x 60 rows
    assert fc["generate_seconds"]["value"] > 0 and "cost_usd" not in fc
    assert set(fc) >= {"output_tokens", "generate_seconds", "gpu_hours", "wall_seconds"}
    # the pilot is rows of the input; the table names the refusal; the group is empty (defaults won)
    pilot = pq.read_table(out / "pilot.parquet").to_pylist()
    assert len(pilot) == 24 and all(r in rows for r in pilot)
    # generate seconds from the winner's timed engine steps and the whole corpus's steps, replayed
    model = result["forecast_model"]
    assert model["pilot"]["steps"] > 0 and model["step_cost"]["per_step"] >= 0
    assert model["pilot"]["requests"] == len({r["text"] for r in pilot})  # identical rows share one
    assert model["full_run"]["requests"] == len({r["text"] for r in rows}) and model["full_run"]["steps"] > 0
    # two rungs of 8 and 16 rows, 6 tokens each: a dozen steps, too few to fit three costs on; the
    # pilot's seconds per computed token forecast instead, and the tune says so
    assert model["model"] == "pilot-rate" and any("steps timed" in why for why in model["refused"])
    assert model["candidates"]["pilot-rate"] > 0 and len(model["pilot_rungs"]) == 2
    assert sum(r["requests"] for r in model["pilot_rungs"]) == model["pilot"]["requests"]
    assert result["choice"]["reason"] == "the fastest measured"  # the only setting that ran: nothing to repeat
    table = (out / "tune.md").read_text()
    assert "generate hours by pilot-rate: " in table
    assert f"| {REFUSED} |" in table and "is below model.max_num_seqs" in table and "| defaults * |" in table
    assert (out / "tune.png").read_bytes()[:4] == b"\x89PNG"
    assert OmegaConf.load(out / "conf" / "tuned" / "best.yaml") == {}
    assert json.loads((out / "tune.json").read_text()) == result
    # submit with the tuned group finds this tune.json (the group names it), its fingerprint is the
    # run's, and a budget under the forecast is refused before any sbatch, naming figure and source
    run_dir = tmp_path / "run"
    gpu_hours = fc["gpu_hours"]["value"]
    res = run_cli(
        ["submit", *args, f"output.dir={run_dir}", "--config-dir", str(out / "conf"), "+tuned=best"]
        + ["--max-gpu-hours", f"{gpu_hours / 2}"],
        timeout=300,
    )
    assert res.returncode == 2, res.stderr[-3000:]
    shown = re.search(r"forecast for this run is ([\d.,]+) GPU-hours \(95% interval", res.stderr)
    assert shown and float(shown[1]) == pytest.approx(gpu_hours, rel=1e-3, abs=2e-4), res.stderr
    assert f"Forecast from {out / 'tune.json'}" in res.stderr and "nothing was submitted" in res.stderr
    assert not (run_dir / "jobs.jsonl").exists() and not (run_dir / "forecast.json").exists()
