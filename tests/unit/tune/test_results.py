"""The tune folder's files: the winning overrides as a config group that `run` takes with the same
fingerprint, the table and the plot."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf
from support.corpus import write_corpus
from support.runs import model_overrides

from batchinfer.config.compose import compose
from batchinfer.rundir.prepare import prepare
from batchinfer.tune import results
from batchinfer.tune.command import config_fingerprint
from batchinfer.tune.halving import Outcome, Rung
from batchinfer.tune.settings import Setting, parse_include, parse_tries

WINNER = Setting(("model.max_num_seqs=8", "model.max_num_batched_tokens=1024"), {"VLLM_CPU_OMP_THREADS_BIND": "0-1"})


def test_winning_overrides_round_trip_into_run_with_the_same_fingerprint(tmp_path: Path, tiny_model_path: Path) -> None:
    corpus = tmp_path / "in.jsonl"
    write_corpus(corpus, 20)
    model = [o for o in model_overrides(tiny_model_path) if not o.startswith("model.max_num_seqs=")]
    base = [f"input.path={corpus}", "input.id_column=id", *model, f"output.dir={tmp_path}/run"]
    results.write_group(tmp_path / "tune", WINNER.override_strings())
    tuned = compose([*base, "+tuned=best"], config_dir=str(tmp_path / "tune" / "conf"))
    assert tuned.model.max_num_seqs == 8 and tuned.model.max_num_batched_tokens == 1024
    assert OmegaConf.to_container(tuned.cluster.env) == {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    default = compose(base)
    assert default.model.max_num_seqs != 8
    assert config_fingerprint(tuned)[1] == config_fingerprint(default)[1]
    first = prepare(default)
    again = prepare(tuned)  # reopens the same run directory: no output-changing key differs
    assert again.path == first.path and again.run["fingerprint"] == first.run["fingerprint"]
    assert first.run["fingerprint"] == config_fingerprint(default)[1]  # what tune.json records is run.yaml's
    assert again.run["config"]["model"]["max_num_seqs"] == 8
    # the command line still wins over the group, as Hydra orders them
    assert (
        compose(
            [*base, "+tuned=best", "model.max_num_seqs=4"], config_dir=str(tmp_path / "tune" / "conf")
        ).model.max_num_seqs
        == 4
    )


def test_defaults_winning_writes_an_empty_group(tmp_path: Path, tiny_model_path: Path) -> None:
    results.write_group(tmp_path, [])
    cfg = compose([*model_overrides(tiny_model_path), "+tuned=best"], config_dir=str(tmp_path / "conf"))
    assert cfg == compose(model_overrides(tiny_model_path))


def outcome(setting: Setting, rate: float, failure: str = "") -> Outcome:
    rung = Rung(0, 10, 50, int(rate), 1.0, prefix_cache_hit_rate=0.25, peak_memory_mb=900.0)
    return Outcome(setting, 12.5, [rung] if not failure else [], failure or None)


def test_table_and_plot(tmp_path: Path) -> None:
    records = [
        results.setting_record(o)
        for o in (
            outcome(Setting(), 100.0),
            outcome(WINNER, 140.0),
            outcome(Setting(("model.max_num_batched_tokens=4",)), 0, "ValueError: refused"),
            outcome(Setting(("quantization=fp8",), changes_outputs=True), 200.0),
        )
    ]
    assert records[1]["overrides"] == [
        "model.max_num_seqs=8",
        "model.max_num_batched_tokens=1024",
        "++cluster.env.VLLM_CPU_OMP_THREADS_BIND=0-1",
    ]
    # the winner's overrides as printed are what `run`/`submit` take on their command line
    cfg = compose(["input.path=x.jsonl", *records[1]["overrides"]])
    assert cfg.cluster.env.VLLM_CPU_OMP_THREADS_BIND == "0-1" and cfg.model.max_num_seqs == 8
    assert records[1]["output_tokens_per_s"] == 140.0 and records[1]["prefix_cache_hit_rate"] == 0.25
    text = results.table(records, WINNER.name).splitlines()
    assert text[3].startswith(f"| {WINNER.name} * | 12.5 | 140.0 | 10.00 | 1 (10) | 25% | 900 |")
    assert text[4].endswith("| ValueError: refused |")
    assert text[5].startswith("| quantization=fp8 † |")
    assert results.plot(records, WINNER.name, tmp_path / "tune.png")
    assert (tmp_path / "tune.png").read_bytes()[:4] == b"\x89PNG"


def test_grid_options_are_checked() -> None:
    from batchinfer.errors import ConfigError

    assert parse_include("fp8, ngram") == ["fp8", "ngram"]
    with pytest.raises(ConfigError, match="--include fp16: unknown; it takes fp8, kv-fp8, ngram"):
        parse_include("fp16")
    assert parse_tries(["defaults", "model.max_num_seqs=8 env.VLLM_CPU_OMP_THREADS_BIND=0-1"]) == [
        Setting(),
        Setting(("model.max_num_seqs=8",), {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}),
    ]
    with pytest.raises(ConfigError, match="'max_num_seqs' is not a key=value override"):
        parse_tries(["max_num_seqs"])
