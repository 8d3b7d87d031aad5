"""Engines per task (cluster.engines_per_task) on the login node: submit refuses a layout the task's
GPUs (or cores) cannot hold, plan shows the engines, report counts each shard's GPU-seconds on the
engine that ran it, status names the engine of a failed shard. No engine, no Slurm."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import pytest
from support.corpus import write_corpus
from support.model_configs import LLAMA_8B
from support.procs import run_cli
from support.runs import fake_model_dir

from batchinfer.config.compose import compose
from batchinfer.config.schema import ClusterConfig, Config, ModelConfig
from batchinfer.durable import write_json
from batchinfer.errors import ConfigError
from batchinfer.insight.report import build_report, format_report
from batchinfer.insight.status import format_status, shard_status, summarize
from batchinfer.launch import slurm
from batchinfer.rundir.prepare import prepare
from batchinfer.rundir.store import RunDir


def layout(gpus: int, engines: Any, tp: int = 1, cpus: Optional[int] = None) -> Config:
    return Config(
        model=ModelConfig(tensor_parallel_size=tp),
        cluster=ClusterConfig(name="slurm", gpus_per_task=gpus, engines_per_task=engines, cpus_per_task=cpus),
    )


# ---------------------------------------------------------------- submit


def test_check_gpus_refuses_more_engines_than_the_task_holds() -> None:
    assert slurm.check_gpus(layout(8, "auto")) == 8
    assert slurm.check_gpus(layout(8, "auto", tp=2)) == 4
    assert slurm.check_gpus(layout(8, 3, tp=2)) == 3  # 2 GPUs idle: allowed
    assert slurm.check_gpus(layout(1, 1)) == 1
    with pytest.raises(ConfigError) as e:
        slurm.check_gpus(layout(4, 4, tp=2))
    msg = str(e.value)
    for key in ("cluster.engines_per_task=4", "model.tensor_parallel_size", "cluster.gpus_per_task=4"):
        assert key in msg, msg
    with pytest.raises(ConfigError, match=r"cluster.gpus_per_task=1 is less than .* = 2"):
        slurm.check_gpus(layout(1, 1, tp=2))  # the old check still comes first


def test_cpu_partition_needs_a_core_per_engine() -> None:
    assert slurm.check_gpus(layout(0, 2, cpus=8)) == 2
    assert slurm.check_gpus(layout(0, 4)) == 4  # cpus_per_task unset: what Slurm gives is checked at run time
    assert slurm.check_gpus(layout(0, "auto", cpus=1)) == 1
    with pytest.raises(ConfigError) as e:
        slurm.check_gpus(layout(0, 4, cpus=2))
    msg = str(e.value)
    assert "cluster.engines_per_task=4" in msg and "cluster.cpus_per_task=2" in msg and "cluster.gpus_per_task=0" in msg


def prepared(tmp_path: Path, rows: int, *extra: str) -> RunDir:
    tmp_path.mkdir(parents=True, exist_ok=True)
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, rows)
    model = fake_model_dir(tmp_path)
    return prepare(compose([f"input.path={corpus}", f"model.path={model}", f"output.dir={tmp_path}/run", *extra]))


def test_dry_run_says_engines_per_task(tmp_path: Path, monkeypatch, capsys) -> None:
    from batchinfer.launch.submit import submit_shards

    monkeypatch.setattr(slurm, "max_array_size", lambda: 1000)
    run = prepared(
        tmp_path,
        12,
        "cluster=slurm",
        "sharding.num_shards=4",
        "cluster.shards_per_task=4",
        "cluster.gpus_per_task=8",
        "cluster.engines_per_task=auto",
        "model.tensor_parallel_size=2",
    )
    submit_shards(run, [0, 1, 2, 3], dry_run=True)
    out = capsys.readouterr().out
    assert "engines per task: 4 (cluster.engines_per_task=auto), 2 GPUs each" in out
    assert "'gpus_per_task': 8" in out

    cpu = prepared(
        tmp_path / "cpu",
        12,
        "cluster=slurm",
        "cluster.gpus_per_task=0",
        "cluster.cpus_per_task=8",
        "cluster.engines_per_task=2",
    )
    submit_shards(cpu, [0], dry_run=True)
    assert "engines per task: 2 (cluster.engines_per_task=2), CPU cores split 2 ways" in capsys.readouterr().out

    bad = prepared(tmp_path / "bad", 12, "cluster=slurm", "cluster.gpus_per_task=2", "cluster.engines_per_task=4")
    with pytest.raises(ConfigError, match=r"cluster.engines_per_task=4 .*cluster.gpus_per_task=2"):
        submit_shards(bad, [0], dry_run=True)


# ---------------------------------------------------------------- plan


def _model(tmp_path: Path) -> Path:
    d = tmp_path / "8b"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(LLAMA_8B))
    return d


def _plan(*args: str, json_out: bool = False) -> Any:
    res = run_cli(["plan", *(["--json"] if json_out else []), *args])
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout) if json_out else " ".join(res.stdout.split())  # long lines wrap


def test_plan_shows_engines_per_task(tmp_path: Path) -> None:
    model = _model(tmp_path)
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 64)
    base = [f"model.path={model}", f"input.path={corpus}", "sharding.num_shards=32", "--gpu", "H100"]
    auto = [*base, "cluster.gpus_per_task=8", "cluster.engines_per_task=auto", "cluster.shards_per_task=16"]
    text = _plan(*auto)
    assert "engines 8 per task (cluster.engines_per_task=auto): 1 GPU each" in text
    assert "of cluster.gpus_per_task=8" in text and "idle" not in text.split("engines 8 per task")[1].split("note")[0]
    assert "about 2 shards per engine (16 shards per task, cluster.shards_per_task), taken one at a time" in text
    e = _plan(*auto, json_out=True)["engines"]
    assert e["setting"] == "auto" and e["engines_per_task"] == 8 and e["gpus_per_engine"] == 1
    assert e["idle_gpus"] == 0 and e["shards_per_task"] == 16 and e["shards_per_engine"] == 2
    assert e["problem"] is None and e["engines_without_shards"] == 0

    # An explicit N that leaves GPUs idle, at tensor parallel 2: 3 x 2 of 8.
    explicit = [*base, "cluster.gpus_per_task=8", "cluster.engines_per_task=3", "model.tensor_parallel_size=2"]
    text = _plan(*explicit, "cluster.shards_per_task=6")
    assert "engines 3 per task (cluster.engines_per_task=3): 2 GPUs each" in text
    assert "of cluster.gpus_per_task=8, 2 idle" in text and "about 2 shards per engine" in text
    e = _plan(*explicit, "cluster.shards_per_task=6", json_out=True)["engines"]
    assert (e["engines_per_task"], e["gpus_per_engine"], e["idle_gpus"]) == (3, 2, 2)
    # Fewer shards per task than engines: the idle engines are named.
    text = _plan(*explicit, "cluster.shards_per_task=2")
    assert "2 shards per task for 3 engines: 1 of them get none; raise cluster.shards_per_task to 3" in text


def test_plan_points_at_engines_and_warns_of_what_submit_refuses(tmp_path: Path) -> None:
    model = _model(tmp_path)
    base = [f"model.path={model}", "--gpu", "H100"]
    # One GPU's worth of model on an 8-GPU task, one engine: 7 GPUs idle, and the layout advice.
    text = _plan(*base, "cluster.gpus_per_task=8")
    assert "run one model copy per GPU" in text and "cluster.engines_per_task=auto" in text
    assert "engines 1 per task (cluster.engines_per_task=1) on 1 of cluster.gpus_per_task=8 GPUs: 7 idle" in text
    assert "cluster.engines_per_task=auto runs 8 engines" in text
    # The default layout (1 GPU, 1 engine) prints no engines line.
    assert "engines " not in _plan(*base, "cluster=slurm").replace("engines_per_task", "")
    # A layout submit refuses is a warning in plan, naming the settings.
    text = _plan(*base, "cluster.gpus_per_task=4", "cluster.engines_per_task=4", "model.tensor_parallel_size=2")
    assert "warning cluster.engines_per_task=4 x model.tensor_parallel_size" in text
    assert "(cluster.gpus_per_task=4)" in text
    e = _plan(
        *base, "cluster.gpus_per_task=4", "cluster.engines_per_task=4", "model.tensor_parallel_size=2", json_out=True
    )["engines"]
    assert e["engines_per_task"] is None and "cluster.engines_per_task=4" in e["problem"]
    # A CPU task: cores split N ways.
    text = _plan(
        *base,
        "cluster.gpus_per_task=0",
        "cluster.cpus_per_task=8",
        "cluster.engines_per_task=2",
        "cluster.shards_per_task=4",
    )
    assert (
        "the task's CPU cores split 2 ways, no GPUs (cluster.gpus_per_task=0; cluster.cpus_per_task=8: 4 each)" in text
    )


# ---------------------------------------------------------------- report


def _shard(run: RunDir, index: int, name: str, rows: int, out_tok: int, seconds: dict, engine: Any = None) -> None:
    rec = {
        "rows_done": rows,
        "prompt_tokens": 10 * rows,
        "output_tokens": out_tok,
        "seconds": seconds,
        "errors": {},
        "series": [],
        "device": "cuda",
    }
    if engine is not None:
        rec["engine"] = engine
    run.shard_dir(index).mkdir(parents=True, exist_ok=True)
    write_json(run.shard_dir(index) / name, rec)


def _two_engine_run(tmp_path: Path, *extra: str) -> RunDir:
    run = prepared(
        tmp_path,
        40,
        "cluster=slurm",
        "sharding.num_shards=4",
        "cluster.shards_per_task=4",
        "cluster.gpus_per_task=8",
        "cluster.engines_per_task=2",
        "model.tensor_parallel_size=2",
        *extra,
    )
    s = {"startup": 100.0, "prepare": 50.0, "generate": 3000.0, "commit": 450.0}  # 3600 s a shard
    e0 = {"index": 0, "of": 2, "devices": "0,1"}
    e1 = {"index": 1, "of": 2, "devices": "2,3"}
    _shard(run, 0, "DONE.json", 10, 3000, s, e0)  # 1.0 tok/s
    _shard(run, 1, "DONE.json", 10, 6000, s, e1)  # 2.0 tok/s
    _shard(run, 2, "DONE.json", 10, 3000, s, e0)
    _shard(run, 3, "progress.json", 5, 1500, dict(s, generate=1500.0, commit=0.0), e1)  # partial
    return run


def test_report_counts_gpu_hours_per_engine(tmp_path: Path) -> None:
    run = _two_engine_run(tmp_path)
    rep = build_report(run, price=2.0)
    c = rep["cost"]
    # Each shard's seconds x 8 GPUs / 2 engines = 4 GPUs (not the task's 8): 3 x 1 h + 1650 s.
    assert c["gpu_hours"] == pytest.approx(4 * (3 + 1650 / 3600), rel=1e-12)
    assert c["engine_layouts"] == [{"engines_per_task": 2, "gpus_per_engine": 4}]
    assert c["usd"] == pytest.approx(2.0 * c["gpu_hours"], rel=1e-12)
    eng = {r["engine"]: r for r in rep["engines"]}
    assert eng[0]["devices"] == ["0,1"] and eng[0]["shards"] == 2 and eng[0]["rows_done"] == 20
    assert eng[0]["generate_seconds"] == 6000.0 and eng[0]["output_tokens_per_s"] == 1.0
    assert eng[1]["devices"] == ["2,3"] and eng[1]["shards"] == 2 and eng[1]["rows_done"] == 15
    assert eng[1]["output_tokens_per_s"] == round(7500 / 4500, 2)
    md = format_report(rep, [])
    assert "## Engines" in md and "| engine | devices | shards | rows | generate s | rows/s | output tok/s |" in md
    assert "| 0 | 0,1 | 2 | 20 | 6,000.0 | 0.0 | 1.0 |" in md and "| 1 | 2,3 | 2 | 15 | 4,500.0 |" in md
    assert "4 per engine for shards of tasks running 2 engines" in md
    assert "a task's cluster.gpus_per_task=8 shared by its engines" in md and "(one engine while generating)" in md
    # The JSON form carries the same table (report --json prints build_report's record).
    res = run_cli(["report", str(run.path), "--json"])
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["engines"] == json.loads(json.dumps(rep["engines"]))


def test_report_engine_count_from_records_then_config(tmp_path: Path) -> None:
    # auto at TP 2 on 8 GPUs gives 4 engines; the records say 2 ran: the records win.
    run = _two_engine_run(tmp_path / "a", "cluster.engines_per_task=auto")
    assert build_report(run)["cost"]["engine_layouts"] == [{"engines_per_task": 2, "gpus_per_engine": 4}]
    # Without records the config's N counts (8 // 4 = 2 GPUs a shard); no engine table.
    run = prepared(
        tmp_path / "b",
        20,
        "cluster=slurm",
        "sharding.num_shards=2",
        "cluster.gpus_per_task=8",
        "cluster.engines_per_task=auto",
        "model.tensor_parallel_size=2",
    )
    s = {"startup": 0.0, "prepare": 0.0, "generate": 3600.0, "commit": 0.0}
    _shard(run, 0, "DONE.json", 10, 100, s)
    _shard(run, 1, "DONE.json", 10, 100, s)
    rep = build_report(run)
    assert rep["cost"]["gpu_hours"] == pytest.approx(2 * 2.0) and rep["engines"] is None
    assert "## Engines" not in format_report(rep, [])
    # A single-engine task: seconds x gpus_per_task, as before.
    run = prepared(tmp_path / "c", 10, "cluster=slurm", "cluster.gpus_per_task=8")
    _shard(run, 0, "DONE.json", 10, 100, s)
    rep = build_report(run)
    assert rep["cost"]["gpu_hours"] == pytest.approx(8.0) and "8 per task)" in format_report(rep, [])
    # CPU tasks of 2 engines: each engine counts as 1 GPU.
    run = prepared(
        tmp_path / "d",
        20,
        "cluster=slurm",
        "sharding.num_shards=2",
        "cluster.gpus_per_task=0",
        "cluster.engines_per_task=2",
    )
    _shard(run, 0, "DONE.json", 10, 100, s, {"index": 0, "of": 2, "devices": "cpu:0-3"})
    _shard(run, 1, "DONE.json", 10, 100, s, {"index": 1, "of": 2, "devices": "cpu:4-7"})
    rep = build_report(run)
    assert rep["cost"]["cpu"] and rep["cost"]["gpu_hours"] == pytest.approx(2.0)
    assert [r["devices"] for r in rep["engines"]] == [["cpu:0-3"], ["cpu:4-7"]]
    assert "CPU tasks, no GPU: each of 2 engines per task counted as 1 GPU" in format_report(rep, [])


# ---------------------------------------------------------------- status


def test_status_names_the_engine_of_a_failed_or_partial_shard(tmp_path: Path) -> None:
    run = _two_engine_run(tmp_path)
    progress = run.shard_dir(1) / "progress.json"  # shard 1 failed on engine 1
    write_json(
        progress,
        {
            "rows_done": 4,
            "output_tokens": 40,
            "seconds": {"generate": 4.0},
            "attempts": 3,
            "last_error": "EngineDeadError: CUDA out of memory",
            "engine": {"index": 1, "of": 2, "devices": "2,3"},
        },
    )
    (run.shard_dir(1) / "DONE.json").unlink()
    records = shard_status(run, {})
    by = {r["shard"]: r for r in records}
    assert by[1]["state"] == "failed" and by[3]["state"] == "partial" and by[0]["state"] == "done"
    assert by[1]["engine"] == {"index": 1, "of": 2, "devices": "2,3"}
    lines = format_status(run, records, summarize(records)).splitlines()
    line = {int(ln.split()[0]): ln for ln in lines[2:-1]}
    assert "engine 1 of 2 (devices 2,3); EngineDeadError: CUDA out of memory" in line[1]
    assert "engine 1 of 2 (devices 2,3)" in line[3]
    assert "engine" not in line[0]  # a done shard's line stays as it was


def test_running_rate_counts_each_engine_of_a_task() -> None:
    def rec(i: int, index: int, rps: float, updated: float) -> dict[str, Any]:
        return {
            "shard": i,
            "state": "running",
            "job": "7_0",
            "rows": 100,
            "rows_done": 10,
            "output_tokens": 100,
            "generate_seconds": 10 / rps,
            "rows_per_s": rps,
            "output_tokens_per_s": 10 * rps,
            "updated": updated,
            "engine": {"index": index, "of": 2, "devices": None},
        }

    # One task, two engines at once: engine 0's latest shard (2.0 rows/s) plus engine 1's (3.0).
    t = summarize([rec(0, 0, 1.0, 1), rec(1, 0, 2.0, 2), rec(2, 1, 3.0, 1)])
    assert t["running_tasks"] == 1 and t["running_rows_per_s"] == 5.0 and t["running_output_tokens_per_s"] == 50.0
