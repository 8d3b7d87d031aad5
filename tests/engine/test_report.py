"""report of runs on the shared engine: finished and partial, table, plot and JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support.corpus import read_output, write_corpus
from support.procs import run_cli
from support.runs import run_overrides as overrides

from batchinfer.config.compose import compose
from batchinfer.rundir.progress import PHASES


def report_overrides(model: Path, corpus: Path, out: Path) -> list[str]:
    return overrides(model, corpus, out, "sharding.num_shards=3", "output.commit_every_rows=8")


def assert_png(path: Path) -> None:
    import matplotlib.image

    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5000, path
    h, w, _ = matplotlib.image.imread(path).shape
    assert h > 200 and w > 400


@pytest.mark.engine
def test_report_of_a_finished_run(tmp_path: Path, tiny_model_path: Path, engine: Any) -> None:
    from batchinfer.launch.local import run_local

    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 90, seed=3)
    run = run_local(compose(report_overrides(tiny_model_path, corpus, tmp_path / "run")), engine=engine)
    res = run_cli(["report", str(run.path), "--gpu-hour-price", "2.5", "--gpu-watts", "300", "--json"])
    assert res.returncode == 0, res.stderr
    rep = json.loads(res.stdout)
    out = read_output(run.path)
    dones = [json.loads(p.read_text()) for p in sorted(run.path.glob("shards/*/DONE.json"))]
    tot = rep["totals"]
    assert not rep["partial"] and rep["merged"]
    assert tot["rows_done"] == len(out) == sum(d["rows_done"] for d in dones) == 90
    assert tot["prompt_tokens"] == sum(r["prompt_tokens"] for r in out) == sum(d["prompt_tokens"] for d in dones)
    assert tot["output_tokens"] == sum(r["output_tokens"] for r in out) == 90 * 6
    for s, d in zip(rep["shards"], dones, strict=True):
        assert (s["rows_done"], s["prompt_tokens"], s["output_tokens"]) == (
            d["rows_done"],
            d["prompt_tokens"],
            d["output_tokens"],
        )
        assert s["output_tokens_per_s"] == round(d["output_tokens"] / d["seconds"]["generate"], 2) > 0
        assert len(d["series"]) >= 3 and d["series"][-1]["rows_done"] == d["rows_done"]
        # Prefix-cache counts come with every finished request (no stat logging needed); identical
        # prompts are sent once, so the engine saw at most the rows' prompt tokens.
        assert (d["prefix_cache"] is not None) == engine.prefix_caching
        if d["prefix_cache"]:
            assert 0 <= d["prefix_cache"]["hits"] <= d["prefix_cache"]["queries"] <= d["prompt_tokens"]
            assert s["prefix_cache_hit_rate"] == round(d["prefix_cache"]["hits"] / d["prefix_cache"]["queries"], 4)
    # Cost: every shard's recorded seconds x 1 (a CPU task counts as one GPU) at $2.50 per GPU-hour.
    c = rep["cost"]
    seconds = sum(d["seconds"].get(p, 0.0) for d in dones for p in PHASES)
    assert c["cpu"] and c["gpus_per_task"] == 1 and c["gpu_hours"] == pytest.approx(seconds / 3600, rel=1e-12)
    assert c["usd"] == c["gpu_hours"] * 2.5 and c["usd_per_1k_output_tokens"] == 1000 * c["usd"] / 540
    assert c["usd_per_1k_total_tokens"] == 1000 * c["usd"] / (tot["prompt_tokens"] + 540)
    assert c["joules_per_output_token"] == pytest.approx(300 * c["gpu_hours"] * 3600 / 540, rel=1e-12)
    # The table (report.md, printed) shows the same totals; the charts are real PNGs.
    text = run_cli(["report", str(run.path), "--gpu-hour-price", "2.5"]).stdout
    md = (run.path / "report" / "report.md").read_text()
    assert text.startswith(md) and "finished: 3 shards, 90 rows" in md
    assert f"| **total** | **90** | **{tot['prompt_tokens']:,}** | **540** |" in md
    assert f"cost ${c['usd']:,.4f}" in md and "CPU tasks, no GPU: each counted as 1 GPU" in md
    for name in ("throughput.png", "time-split.png", "lengths.png"):
        assert_png(run.path / "report" / name)
        assert f"]({name})" in md


@pytest.mark.engine
def test_report_of_a_partial_run_says_partial(tmp_path: Path, tiny_model_path: Path, engine: Any) -> None:
    from batchinfer.launch.local import run_shards
    from batchinfer.rundir.prepare import prepare

    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 60, seed=4)
    run = prepare(compose(report_overrides(tiny_model_path, corpus, tmp_path / "run")))
    run_shards(run, [1], engine=engine)
    res = run_cli(["report", str(run.path), "--gpu", "a100-80"])
    assert res.returncode == 0, res.stderr
    assert "**partial run**: 1 of 3 shards done, 20 of 60 rows committed" in res.stdout
    assert "| 0 | 0 of 20 |" in res.stdout and "$1.79 per GPU-hour (A100-80GB preset (assumed" in res.stdout
    rep = json.loads((run.path / "report" / "report.json").read_text())
    assert rep["partial"] and not rep["merged"] and rep["totals"]["rows_done"] == 20
    assert_png(run.path / "report" / "lengths.png")  # from the committed parts


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
