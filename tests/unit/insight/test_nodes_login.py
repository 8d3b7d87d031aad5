"""An engine over several nodes (cluster.nodes_per_task) on the login node: report counts every
node's GPUs, status names a task's nodes, plan sizes per GPU at TP x PP over nodes and says when
the weights need more than one node. No engine, no Slurm (fake sacct)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from support.fake_engine import prepared

from batchinfer.durable import write_json
from batchinfer.insight.report import build_report, format_report
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


# ---------------------------------------------------------------- status

# Array 200 (shards 0-2), a one-task array submitted as the plain job 201 (shard 3), as sacct -X
# lists them with SACCT_FIELDS (JobID,State,ExitCode,NodeList).
SACCT_NODES = """200_0|COMPLETED|0:0|node1
200_1|FAILED|1:0|gpu[07-08]
200_2|RUNNING|0:0|gpu[03-04]
201|FAILED|1:0|gpu12
202_[0-1]|PENDING|0:0|None assigned
"""


@pytest.fixture
def fake_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """sacct and squeue first on PATH: sacct prints SACCT_NODES, squeue nothing; calls in *.calls."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for name, out in (("sacct", SACCT_NODES), ("squeue", "")):
        (folder / f"{name}.out").write_text(out)
        (folder / name).write_text('#!/bin/sh\nprintf "%s\\n" "$*" >> "$0.calls"\ncat "$0.out"\n')
        (folder / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    return folder


def test_read_sacct_keeps_each_tasks_nodes() -> None:
    from batchinfer.launch.sacct import read_sacct

    tasks = read_sacct(SACCT_NODES + "200_1.batch|FAILED|1:0|gpu07\n")
    assert {k: t.nodes for k, t in tasks.items()} == {
        "200_0": "node1",
        "200_1": "gpu[07-08]",  # its own line, not its batch step's (the first node alone)
        "200_2": "gpu[03-04]",
        "201": "gpu12",
        "202_0": None,  # pending: "None assigned"
        "202_1": None,
    }
    assert tasks["200_1"].state == "FAILED" and tasks["200_2"].state == "RUNNING"
    assert read_sacct("7_1|RUNNING\n")["7_1"].nodes is None  # fewer columns: read as before


def test_status_names_the_nodes_of_running_and_failed_tasks(
    tmp_path: Path, fake_slurm: Path, capsys: pytest.CaptureFixture
) -> None:
    from batchinfer.cli import main

    run = node_run(tmp_path, "sharding.num_shards=4", "model.tensor_parallel_size=2")
    folder = run.logs_dir / "submission-000"
    folder.mkdir(parents=True)
    jobs = [
        {"submission": 0, "time": 1.0, "folder": str(folder), "name": "bi-x-0"},
        {"submission": 0, "array": 0, "job_id": "200", "tasks": {"0": [0], "1": [1], "2": [2]}},
        {"submission": 0, "array": 1, "job_id": "201", "tasks": {"0": [3]}},
        {"submission": 0, "merge": "203"},
    ]
    (run.path / "jobs.jsonl").write_text("".join(json.dumps(x) + "\n" for x in jobs))
    done_shard(run, 0, HOUR)
    (folder / "200_1_0_log.err").write_text("RuntimeError: the engine ranks on gpu08 exited\n")
    try:
        assert main(["status", str(run.path), "--json"]) == 0
        got = {s["shard"]: (s["state"], s["nodes"]) for s in json.loads(capsys.readouterr().out)["shards"]}
        assert main(["status", str(run.path)]) == 0
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR2})  # main blocks it for workers
    assert got == {
        0: ("done", None),  # done: no nodes to look at
        1: ("failed", "gpu[07-08]"),
        2: ("running", "gpu[03-04]"),
        3: ("failed", "gpu12"),  # a one-task array: the plain job 201 to Slurm
    }
    lines = {int(ln.split()[0]): ln for ln in capsys.readouterr().out.splitlines()[2:6]}
    assert lines[1].endswith("on gpu[07-08]; RuntimeError: the engine ranks on gpu08 exited")
    assert lines[2].endswith("on gpu[03-04]") and lines[3].endswith("on gpu12")
    assert " on " not in lines[0]
    calls = (fake_slurm / "sacct.calls").read_text().splitlines()
    # one sacct call per status, as before: the nodes come with the states
    assert calls == ["-n -P -X -o JobID,State,ExitCode,NodeList -j 200,201,203"] * 2


# ---------------------------------------------------------------- plan

# Llama-3.1-405B's shape: about 812 GB of weights in BF16, more than a node of 8 x 80 GB holds.
LLAMA_405B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 16384,
    "intermediate_size": 53248,
    "num_attention_heads": 128,
    "num_key_value_heads": 8,
    "num_hidden_layers": 126,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}


def plan_of(tmp_path: Path, *overrides: str) -> tuple[dict[str, Any], str]:
    from batchinfer.config.compose import compose
    from batchinfer.insight.plan import estimate
    from batchinfer.insight.plan_text import format_plan

    folder = tmp_path / "405b"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(LLAMA_405B))
    report = estimate(compose([f"model.path={folder}", *overrides]), gpu="H100")
    return report, " ".join(format_plan(report).split())  # long lines wrap


def test_plan_says_when_the_weights_need_more_than_one_node(tmp_path: Path) -> None:
    report, text = plan_of(tmp_path, "model.max_model_len=32768")
    g = report["gpus"][0]
    assert g["recommended_tp"] is None  # no TP up to 8 holds it
    assert g["recommended_nodes"] == {
        "nodes_per_task": 2,
        "gpus_per_node": 8,
        "tensor_parallel_size": 8,
        "pipeline_parallel_size": 2,
        "weight_bytes_per_gpu": -(-report["model"]["weight_bytes"] // 16),
        "max_seqs_at_max_model_len": g["recommended_nodes"]["max_seqs_at_max_model_len"],
        "settings": "cluster.nodes_per_task=2 cluster.gpus_per_task=8 model.tensor_parallel_size=8 "
        "model.pipeline_parallel_size=2",
    }
    assert g["recommended_nodes"]["max_seqs_at_max_model_len"] >= 4
    assert "layout needs more than one node: no tensor parallel size up to 8 (one node of 8 H100-80GB)" in text
    assert "over 2 nodes (tensor parallel inside a node, pipeline parallel across nodes): " in text
    assert "cluster.nodes_per_task=2 cluster.gpus_per_task=8 model.tensor_parallel_size=8 " in text
    assert "quantize (quantization=fp8)" not in text
    # FP8 halves the weights: one node of 8 holds them, no nodes proposed
    report, text = plan_of(tmp_path, "model.max_model_len=32768", "quantization.method=fp8")
    assert report["gpus"][0]["recommended_tp"] == 8 and report["gpus"][0]["recommended_nodes"] is None
    assert "more than one node" not in text


def test_plan_sizes_per_gpu_at_tp_x_pp_over_nodes(tmp_path: Path) -> None:
    from batchinfer.models.sizing import GB

    layout = ["cluster=slurm", "cluster.nodes_per_task=2", "cluster.gpus_per_task=8"]
    layout += ["model.tensor_parallel_size=8", "model.pipeline_parallel_size=2", "model.max_model_len=32768"]
    report, text = plan_of(tmp_path, *layout)
    g, weights = report["gpus"][0], report["model"]["weight_bytes"]
    usable = int(80 * GB * 0.9)
    assert g["weight_bytes_per_gpu"] == -(-weights // 16)  # 1/16 of the weights, not 1/8
    # a GPU holds 63 of the 126 layers' KV, 1 of the 8 KV heads: 2 x 63 x 1 x 128 x 2 bytes a token
    assert g["kv_tokens"] == (usable - g["weight_bytes_per_gpu"]) // (2 * 63 * 128 * 2)
    assert g["warnings"] == [] and (g["pipeline_parallel_size"], g["nodes_per_task"]) == (2, 2)
    assert (
        "gpu H100-80GB, tensor_parallel_size=8 x pipeline_parallel_size=2 over cluster.nodes_per_task=2 nodes" in text
    )
    assert "nodes 2 (cluster.nodes_per_task=2), 8 GPUs on each: one engine of TP 8 x PP 2 = 16 ranks" in text
    # at 4 nodes' worth of stages the KV cache per GPU grows: the stage holds a quarter of the layers
    report, _ = plan_of(
        tmp_path,
        *layout[:1],
        "cluster.nodes_per_task=4",
        *layout[2:3],
        "model.pipeline_parallel_size=4",
        "model.tensor_parallel_size=8",
        "model.max_model_len=32768",
    )
    assert report["gpus"][0]["kv_tokens"] == (usable - -(-weights // 32)) // (2 * 32 * 128 * 2)
