"""cluster.engines_per_task in tune: which counts the default grid tries on a whole node or on
several cores, and the forecast of a winner with several engines (its rate is the task's; the
forecast takes one engine's)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support.runs import fake_model_dir

from batchinfer.config.compose import compose
from batchinfer.config.schema import to_config
from batchinfer.tune.command import Options, finish, layout, with_overrides
from batchinfer.tune.halving import Outcome, Rung, best, halve
from batchinfer.tune.results import setting_record
from batchinfer.tune.sample import Prompts
from batchinfer.tune.settings import Setting, default_grid

EVERY_CORE = {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}
TWO_ENGINES = "cluster.engines_per_task=2"


def cfg(tmp: Path, *overrides: str) -> Any:
    return to_config(compose([f"input.path={tmp}/c.jsonl", f"model.path={fake_model_dir(tmp)}", *overrides]))


def engine_settings(c: Any, gpus: int, cpus: list[int]) -> list[Setting]:
    return [s for s in default_grid(c, gpus, cpus, []) if any("engines_per_task" in o for o in s.overrides)]


def test_a_whole_node_tries_the_engine_counts_that_divide_it(tmp_path: Path) -> None:
    tp2 = cfg(tmp_path, "cluster.gpus_per_task=8", "model.tensor_parallel_size=2")
    assert [s.overrides for s in engine_settings(tp2, 8, [0, 1])] == [
        ("cluster.engines_per_task=2",),
        ("cluster.engines_per_task=4",),
    ]
    tp1 = cfg(tmp_path, "cluster.gpus_per_task=8")
    assert [s.name for s in engine_settings(tp1, 8, [0])] == [f"cluster.engines_per_task={n}" for n in (2, 4, 8)]
    assert all(not s.env and not s.changes_outputs for s in engine_settings(tp1, 8, [0]))
    # already 2 engines: only more (fewer would leave GPUs of the task idle); auto fills the node
    two = cfg(tmp_path, "cluster.gpus_per_task=8", "cluster.engines_per_task=2")
    assert [s.name for s in engine_settings(two, 8, [0])] == [
        "cluster.engines_per_task=4",
        "cluster.engines_per_task=8",
    ]
    auto = cfg(tmp_path, "cluster.gpus_per_task=8", "cluster.engines_per_task=auto")
    assert engine_settings(auto, 8, [0]) == []
    # one engine's worth of GPUs: nothing to try
    assert engine_settings(cfg(tmp_path, "cluster.gpus_per_task=1"), 1, [0, 1]) == []
    assert engine_settings(cfg(tmp_path, "cluster.gpus_per_task=2", "model.tensor_parallel_size=2"), 2, [0]) == []


def test_two_cores_try_two_engines_one_core_nothing(tmp_path: Path) -> None:
    c = cfg(tmp_path)
    grid = default_grid(c, 0, [0, 1], [])
    assert [s for s in grid if s.env] == [Setting(env=EVERY_CORE)]  # one engine on every core, as before
    assert engine_settings(c, 0, [0, 1]) == [Setting(("cluster.engines_per_task=2",))]
    assert engine_settings(c, 0, [0]) == [] and not [s for s in default_grid(c, 0, [0], []) if s.env]
    # a config that runs two engines already tries one, on every core (not the binding alone, which
    # a task of two engines replaces with each engine's own core)
    two = cfg(tmp_path, "cluster.engines_per_task=2")
    assert engine_settings(two, 0, [0, 1]) == [Setting(("cluster.engines_per_task=1",), env=EVERY_CORE)]
    assert [s for s in default_grid(two, 0, [0, 1], []) if s.env] == engine_settings(two, 0, [0, 1])


def outcome(engines: int, aggregate: float, startup: float) -> Outcome:
    """A setting that generated 200 tokens (20 rows of 10) at `aggregate` tok/s, all its engines
    together, measured twice alike (a rung and its repeat)."""
    overrides = (f"cluster.engines_per_task={engines}",) if engines > 1 else ()
    rung = Rung(0, 20, 100, 200, 200 / aggregate, output_lengths=[10] * 20, engines=engines)
    return Outcome(Setting(overrides), startup, [rung], repeats=[rung])


def forecast_of(tmp: Path, outcomes: list[Outcome]) -> dict[str, Any]:
    tmp.mkdir()
    c = cfg(tmp, "sharding.num_shards=4", "cluster.array_parallelism=2")
    prompts = Prompts([f"row {i}" for i in range(1000)], [5] * 1000, "tokens")
    return finish(c, Options([]), tmp / "tune", "f" * 64, prompts, list(range(20)), outcomes, (2.0, "test"))


def test_a_winner_with_two_engines_forecasts_with_one_engines_rate(tmp_path: Path) -> None:
    one, two = outcome(1, 60.0, 3.0), outcome(2, 100.0, 5.0)
    assert two.output_tokens_per_s == 100.0 and two.per_engine("output_tokens") == 50.0  # the task's rate, halved
    assert best([one, two]) is two  # settings compare per task: 100 tok/s beats 60
    result = forecast_of(tmp_path / "a", [one, two])
    assert result["best"]["overrides"] == ["cluster.engines_per_task=2"]
    assert result["layout"] == {
        "rows": 1000,
        "array_tasks": 4,
        "engines_per_task": 2,  # the winner's, not the config's 1
        "devices_per_engine": 1,
        "array_parallelism": 2,
    }
    fc = {k: v["value"] for k, v in result["forecast"].items()}
    assert fc["output_tokens"] == 10_000  # 10 tokens a row x 1000 rows
    assert fc["generate_seconds"] == pytest.approx(200.0)  # engine-seconds at 50 tok/s per engine
    assert fc["engine_starts"] == 8  # 4 tasks x 2 engines
    assert fc["gpu_hours"] == round((200 + 8 * 5) / 3600, 4)  # as tune.json rounds it
    # 2 waves of tasks; each task: 2,500 tokens at 100 tok/s (both engines) after a 5 s start
    assert fc["wall_seconds"] == pytest.approx(2 * (5 + 25.0))
    # one engine at 50 tok/s spends the same engine-seconds; each task takes twice as long
    alone = forecast_of(tmp_path / "b", [outcome(1, 50.0, 5.0)])
    assert alone["layout"]["engines_per_task"] == 1
    assert alone["forecast"]["generate_seconds"]["value"] == pytest.approx(200.0)
    assert alone["forecast"]["wall_seconds"]["value"] == pytest.approx(2 * (5 + 50.0))


def test_layout_takes_the_winners_engines(tmp_path: Path) -> None:
    c = cfg(tmp_path, "cluster.gpus_per_task=8", "model.tensor_parallel_size=2")
    assert layout(c, 100).engines_per_task == 1
    tuned = with_overrides(c, ["model.max_num_seqs=64", "cluster.engines_per_task=4"])
    assert layout(tuned, 100).engines_per_task == 4 and tuned.model.max_num_seqs == 64
    assert layout(with_overrides(c, ["cluster.engines_per_task=auto"]), 100).engines_per_task == 4  # 8 GPUs / TP 2


class PerRungTrial:
    """A task of two engines: no engine at start, each rung starts its own (5 s, then 7 s)."""

    def __init__(self, setting: Setting):
        self.setting = setting

    def start(self, timeout: float) -> None:
        return None

    def rung(self, index: int, timeout: float) -> Rung:
        rows = 10 * 2**index
        return Rung(index, rows, rows, rows * 8, rows * 8 / 100.0, engines=2, startup_seconds=5.0 + 2 * index)

    def stop(self) -> None:
        pass


def test_engines_started_per_rung_give_the_setting_their_mean_start_up() -> None:
    (out,) = halve([Setting((TWO_ENGINES,))], 2, PerRungTrial, 600.0)
    assert out.failure is None and len(out.rungs) == 2
    assert out.startup_seconds == 6.0  # the mean of 5 and 7, kept apart from the rate
    assert out.output_tokens_per_s == pytest.approx(100.0) and out.engines == 2
    assert out.per_engine("output_tokens") == pytest.approx(50.0)
    assert setting_record(out)["engines"] == 2 and setting_record(out)["startup_seconds"] == 6.0


def test_a_run_of_several_lora_adapters_tries_one_slot_and_every_adapter(tmp_path: Path) -> None:
    import json

    adapters = []
    for name in ("a1", "a2", "a3"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
        adapters.append(f"+model.lora.adapters.{name}={tmp_path / name}")

    def tried(c: Any) -> list[str]:
        return [s.name for s in default_grid(c, 0, [0], []) if any("max_loras" in o for o in s.overrides)]

    assert tried(cfg(tmp_path, *adapters)) == ["model.lora.max_loras=1"]  # unset: all three at once already
    assert tried(cfg(tmp_path, *adapters, "model.lora.max_loras=1")) == ["model.lora.max_loras=3"]
    assert tried(cfg(tmp_path, *adapters, "model.lora.max_loras=2")) == [
        "model.lora.max_loras=1",
        "model.lora.max_loras=3",
    ]
    assert tried(cfg(tmp_path, adapters[0])) == [] and tried(cfg(tmp_path)) == []
    assert not any(s.changes_outputs for s in default_grid(cfg(tmp_path, *adapters), 0, [0], []))
