"""An engine over several nodes (cluster.nodes_per_task) on the login node: report counts every
node's GPUs, status names a task's nodes, plan sizes per GPU at TP x PP over nodes and says when
the weights need more than one node. No engine, no Slurm (fake sacct)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.fake_engine import prepared

from batchinfer.insight.report import build_report, format_report
from batchinfer.rundir.durable import write_json
from batchinfer.rundir.store import RunDir

HOUR = {"startup": 300.0, "prepare": 0.0, "generate": 3000.0, "commit": 300.0}  # 3600 s a shard


def done_shard(run: RunDir, index: int, seconds: dict[str, float], device: str = "cuda") -> None:
    """A finished shard's DONE.json with these seconds."""
    rec = {
        "rows_done": 4,
        "prompt_tokens": 40,
        "output_tokens": 100,
        "seconds": seconds,
        "errors": {},
        "series": [],
        "device": device,
    }
    run.shard_dir(index).mkdir(parents=True, exist_ok=True)
    write_json(run.shard_dir(index) / "DONE.json", rec)


def node_run(tmp_path: Path, *extra: str) -> RunDir:
    return prepared(tmp_path, 8, "cluster=slurm", "sharding.num_shards=2", "cluster.nodes_per_task=2", *extra)


# ---------------------------------------------------------------- report


def test_report_counts_the_gpus_of_every_node(tmp_path: Path) -> None:
    run = node_run(
        tmp_path, "cluster.gpus_per_task=8", "model.tensor_parallel_size=8", "model.pipeline_parallel_size=2"
    )
    done_shard(run, 0, HOUR)
    done_shard(run, 1, dict(HOUR, generate=1200.0))  # 1800 s
    rep = build_report(run, price=2.0)
    c = rep["cost"]
    # 2 nodes x 8 GPUs = 16 GPUs for 1.5 h: 24 GPU-hours (one node's 8 would be 12)
    assert c["gpus_per_task"] == 16 and c["nodes_per_task"] == 2 and not c["cpu"]
    assert c["gpu_hours"] == pytest.approx(24.0, rel=1e-12) and c["usd"] == pytest.approx(48.0, rel=1e-12)
    md = format_report(rep, [])
    assert "seconds x GPUs: 16 per task: cluster.nodes_per_task=2 nodes x 8 GPUs on each)" in md


def test_report_counts_each_node_of_a_cpu_task_as_one_gpu(tmp_path: Path) -> None:
    run = node_run(tmp_path, "cluster.gpus_per_task=0", "model.tensor_parallel_size=2")
    done_shard(run, 0, HOUR, device="cpu")
    done_shard(run, 1, HOUR, device="cpu")
    c = build_report(run)["cost"]
    assert c["cpu"] and c["gpu_hours"] == pytest.approx(4.0, rel=1e-12)  # 2 shard-hours x 2 nodes
    assert "each of a task's 2 nodes (cluster.nodes_per_task) counted as 1 GPU" in format_report(build_report(run), [])


def test_one_node_runs_are_counted_as_before(tmp_path: Path) -> None:
    run = prepared(tmp_path, 8, "cluster=slurm", "sharding.num_shards=2", "cluster.gpus_per_task=4")
    done_shard(run, 0, HOUR)
    done_shard(run, 1, HOUR)
    rep = build_report(run)
    assert rep["cost"]["gpu_hours"] == pytest.approx(8.0) and rep["cost"]["nodes_per_task"] == 1
    assert "(start-up + prepare + generate + commit seconds x GPUs: 4 per task)" in format_report(rep, [])
