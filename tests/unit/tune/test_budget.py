"""`submit --max-gpu-hours` / `--max-cost`: the forecast of this config's tune result, scaled to the
run being submitted, refuses before any sbatch when over the budget, naming the forecast and its
tune.json; without a tune result for this config (same fingerprint) it says how to make one.
Through the CLI in this process, with the Slurm submission replaced by a recorder."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
from support.corpus import write_corpus
from support.runs import model_overrides
from support.tune_result import STARTUP, WINNER, make_tune

from batchinfer import cli
from batchinfer.config.compose import compose
from batchinfer.launch import submit as submit_module
from batchinfer.tune.command import config_fingerprint

FIGURE = re.compile(r"is ([\d.,]+) (GPU-hours|USD) \(95% interval ([\d.,]+) \.\. ([\d.,]+)\)")


@pytest.fixture
def base(tmp_path: Path, tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A 40-row corpus in 4 shards, one per array task; cwd is tmp_path (the default tune folder's base)."""
    monkeypatch.chdir(tmp_path)
    write_corpus(tmp_path / "in.jsonl", 40)
    model = [o for o in model_overrides(tiny_model_path) if not o.startswith("model.max_num_seqs=")]
    return [
        f"input.path={tmp_path / 'in.jsonl'}",
        "input.id_column=id",
        *model,
        "sampling.max_tokens=6",
        "sharding.num_shards=4",
        f"output.dir={tmp_path / 'run'}",
    ]


@pytest.fixture
def sbatch(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The shards each submission would have sent to sbatch."""
    calls: list[list[int]] = []

    def record(run: Any, indices: list[int], dry_run: bool = False, heal: bool = False) -> dict[str, Any]:
        calls.append(indices)
        return {}

    monkeypatch.setattr(submit_module, "submit_shards", record)
    return calls


def submit(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(["submit", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def tuned(tmp_path: Path) -> list[str]:
    return ["--config-dir", str(tmp_path / "tune" / "conf"), "+tuned=best"]


def test_over_budget_refuses_before_sbatch_naming_the_forecast_and_its_tune_json(
    tmp_path: Path, base: list[str], sbatch: list[list[int]], capsys: pytest.CaptureFixture[str]
) -> None:
    result = make_tune(tmp_path / "tune", base)
    gpu_hours = result["forecast"]["gpu_hours"]
    code, out, err = submit([*base, *tuned(tmp_path), "--max-gpu-hours", f"{gpu_hours['value'] * 0.9}"], capsys)
    assert code == 2 and sbatch == []
    assert "over the budget; nothing was submitted" in err and str(tmp_path / "tune" / "tune.json") in err
    value, unit, low, high = FIGURE.search(err).groups()
    assert unit == "GPU-hours"
    for shown, key in ((value, "value"), (low, "low"), (high, "high")):
        assert float(shown.replace(",", "")) == pytest.approx(gpu_hours[key], rel=1e-3)
    assert "40 rows, 4 array tasks x 1 engines" in err  # the run's own scale
    assert not (tmp_path / "run" / "forecast.json").exists()


def test_within_budget_submits_and_records_the_forecast_at_the_runs_layout(
    tmp_path: Path, base: list[str], sbatch: list[list[int]], capsys: pytest.CaptureFixture[str]
) -> None:
    result = make_tune(tmp_path / "tune", base)  # 4 array tasks: 4 engine starts
    # submitted with 2 shards per task: 2 engine starts, the same engine seconds per row
    code, out, err = submit([*base, *tuned(tmp_path), "cluster.shards_per_task=2", "--max-gpu-hours", "100"], capsys)
    assert code == 0, err
    assert sbatch == [[0, 1, 2, 3]]
    rec = json.loads((tmp_path / "run" / "forecast.json").read_text())
    assert rec["source"] == str(tmp_path / "tune" / "tune.json") and rec["fingerprint"] == result["fingerprint"]
    assert rec["tuned_settings_used"] and rec["tuned_overrides"] == WINNER and rec["rows"] == 40
    fc, fig = result["forecast"], rec["figures"]
    assert fig["engine_starts"]["value"] == 2 and fc["engine_starts"]["value"] == 4
    for key in ("value", "low", "high"):
        assert fig["output_tokens"][key] == pytest.approx(fc["output_tokens"][key])
        assert fig["generate_seconds"][key] == pytest.approx(fc["generate_seconds"][key], abs=1e-3)
        assert fig["gpu_hours"][key] == pytest.approx(fc["gpu_hours"][key] - 2 * STARTUP / 3600, abs=1e-3)
    assert fig["output_tokens_per_s"]["value"] == pytest.approx(0.5)
    assert (
        f"forecast from {tmp_path / 'tune' / 'tune.json'} (+tuned=best)" in out and "recorded in forecast.json" in out
    )


def test_without_a_tune_result_it_says_how_to_make_one_then_finds_the_default_folder(
    tmp_path: Path, base: list[str], sbatch: list[list[int]], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = submit([*base, "--max-gpu-hours", "5"], capsys)
    fp = config_fingerprint(compose(base))[1]
    assert code == 2 and sbatch == []
    assert f"no tune result for this config (fingerprint {fp[:8]})" in err
    assert f"`{shlex.join(['batchinfer', 'tune', *base])}`" in err  # the same overrides
    assert f"runs/tune-in-{fp[:8]}/tune.json" in err  # where it looked
    # the tune's default folder, from this folder: found without --tune or the group
    make_tune(tmp_path / "runs" / f"tune-in-{fp[:8]}", base)
    code, out, err = submit([*base, "--max-gpu-hours", "100"], capsys)
    assert code == 0 and sbatch == [[0, 1, 2, 3]], err
    assert "the default tune folder" in out
    assert "which this config does not use: add `--config-dir" in out  # the winner's settings are not in it
    assert not json.loads((tmp_path / "run" / "forecast.json").read_text())["tuned_settings_used"]


def test_a_tune_result_of_another_config_is_refused_throughput_knobs_are_not(
    tmp_path: Path, base: list[str], sbatch: list[list[int]], capsys: pytest.CaptureFixture[str]
) -> None:
    other = [o for o in base if not o.startswith("sampling.max_tokens")] + ["sampling.max_tokens=7"]
    result = make_tune(tmp_path / "tune", other)
    code, out, err = submit([*base, "--tune", str(tmp_path / "tune"), "--max-gpu-hours", "100"], capsys)
    fp = config_fingerprint(compose(base))[1]
    assert code == 2 and sbatch == []
    assert f"is a tune result for another config (fingerprint {result['fingerprint'][:8]}" in err
    assert f"this config: {fp[:8]}" in err and "sampling.max_tokens=7" in err
    # throughput knobs stay outside the fingerprint: a tune of the same config with them is accepted
    make_tune(tmp_path / "tune", base)
    code, out, err = submit(
        [*base, "model.max_num_seqs=4", "--tune", str(tmp_path / "tune" / "tune.json"), "--max-gpu-hours", "100"],
        capsys,
    )
    assert code == 0 and sbatch == [[0, 1, 2, 3]], err


def test_max_cost_needs_a_price_and_uses_the_one_given(
    tmp_path: Path, base: list[str], sbatch: list[list[int]], capsys: pytest.CaptureFixture[str]
) -> None:
    result = make_tune(tmp_path / "tune", base)  # tuned without --gpu-hour-price
    code, out, err = submit([*base, *tuned(tmp_path), "--max-cost", "1"], capsys)
    assert code == 2 and sbatch == []
    assert "--max-cost 1: no GPU-hour price for the forecast" in err and "--gpu-hour-price USD" in err
    code, out, err = submit([*base, *tuned(tmp_path), "--max-cost", "1", "--gpu-hour-price", "2.5"], capsys)
    assert code == 2 and sbatch == []
    value, unit, low, high = FIGURE.search(err).groups()
    assert unit == "USD" and float(value) == pytest.approx(2.5 * result["forecast"]["gpu_hours"]["value"], rel=1e-3)
    assert "at 2.5 USD per GPU-hour (--gpu-hour-price)" in err
    # a price the tune recorded is used when none is given
    make_tune(tmp_path / "tune", base, price=2.5)
    code, out, err = submit([*base, *tuned(tmp_path), "--max-cost", "1000"], capsys)
    assert code == 0 and sbatch == [[0, 1, 2, 3]], err
    rec = json.loads((tmp_path / "run" / "forecast.json").read_text())
    assert rec["price"] == 2.5 and "recorded by the tune" in rec["price_source"]
    assert rec["figures"]["cost_usd"]["value"] == pytest.approx(2.5 * rec["figures"]["gpu_hours"]["value"])
