"""`batchinfer report` (table, charts, cost) and the throughput figures behind it and `status`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from support import REPO
from support.corpus import write_corpus
from support.runs import fake_model_dir

from batchinfer.config.compose import compose
from batchinfer.insight.cost import GPU_HOUR_PRICES, cost
from batchinfer.insight.status import summarize
from batchinfer.rundir.progress import SERIES_POINTS, PrefixCache, Progress, rates

# ---------------------------------------------------------------- arithmetic, no engine


def test_cost_arithmetic_is_exact() -> None:
    tot = {
        "seconds": {"startup": 1800.0, "prepare": 0.0, "generate": 5400.0, "commit": 0.0},
        "prompt_tokens": 80_000,
        "output_tokens": 20_000,
    }
    c = cost(tot, 2, price=2.5, watts=500)
    assert c["gpu_hours"] == 4.0 and c["gpus_per_task"] == 2 and not c["cpu"]
    assert c["usd"] == 10.0 and c["usd_per_1k_output_tokens"] == 0.5 and c["usd_per_1k_total_tokens"] == 0.1
    assert c["kwh"] == 2.0 and c["joules_per_output_token"] == 360.0 and c["joules_per_total_token"] == 72.0
    cpu = cost(tot, 0, gpu="h100")  # CPU tasks count as one GPU each; a preset's assumed price
    assert cpu["cpu"] and cpu["gpu_hours"] == 2.0 and cpu["usd"] == 2.0 * GPU_HOUR_PRICES["H100-80GB"]
    assert "assumed" in cpu["price_source"] and "usd" not in cost(tot, 1)


def test_series_is_thinned_to_its_cap() -> None:
    progress = Progress(shard=0)
    for i in range(3 * SERIES_POINTS):
        progress.rows_done, progress.output_tokens = i, 10 * i
        progress.add_point()
        assert len(progress.series) <= SERIES_POINTS
    rows = [p["rows_done"] for p in progress.series]
    assert rows[0] == 0 and rows[-1] == 3 * SERIES_POINTS - 1 and rows == sorted(rows)
    assert len(json.dumps(progress.series)) < 40_000  # progress.json stays small


def test_rates_and_eta_of_running_tasks() -> None:
    rec = rates(100, 20, 0, 4.0, None)
    assert rec.output_tokens_per_s == 5.0 and rec.total_tokens_per_s == 30.0
    assert rec.prefix_cache_hit_rate is None  # engine did not report it
    assert rates(0, 0, 0, 0.0, PrefixCache(queries=200, hits=50)).prefix_cache_hit_rate == 0.25

    def shard(i: int, state: str, job: str, done: int, rps: Any, updated: float = 0) -> dict[str, Any]:
        return {
            "shard": i,
            "state": state,
            "job": job,
            "rows": 100,
            "rows_done": done,
            "output_tokens": done * 10,
            "generate_seconds": done / rps if rps else 0.0,
            "rows_per_s": rps,
            "output_tokens_per_s": rps * 10 if rps else None,
            "updated": updated,
        }

    records = [
        shard(0, "done", "7_0", 100, 2.0),
        shard(1, "running", "7_1", 50, 1.0),
        shard(2, "running", "7_2", 0, None),  # engine starting: counts at the mean known rate, 1.5
        shard(3, "running", "7_3", 40, 4.0, updated=2),  # task 7_3 runs shards 3 and 4 one at a time
        shard(4, "running", "7_3", 20, 3.0, updated=1),
        shard(5, "pending", "7_4", 0, None),
    ]
    t = summarize(records)
    assert t["running_tasks"] == 3 and t["running_rows_per_s"] == 1.0 + 2.5 + 4.0
    assert t["eta_seconds"] == round((600 - 210) / 7.5) and t["running_output_tokens_per_s"] == 75.0


# ---------------------------------------------------------------- login-node commands


LOGIN_NODE = """
import sys
from batchinfer.cli import main
code = main(sys.argv[1:])
heavy = sorted(m for m in ("vllm", "torch", "transformers") if m in sys.modules)
print("CODE", code, "HEAVY", heavy)
"""


def test_report_imports_no_vllm_or_torch(tmp_path: Path) -> None:
    from batchinfer.rundir.prepare import prepare

    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 10)
    run = prepare(
        compose([f"input.path={corpus}", f"model.path={fake_model_dir(tmp_path)}", f"output.dir={tmp_path}/r"])
    )
    args = ["report", str(run.path), "--gpu", "h100", "--gpu-watts", "700"]
    res = subprocess.run([sys.executable, "-c", LOGIN_NODE, *args], capture_output=True, text=True, timeout=120)
    assert "CODE 0 HEAVY []" in res.stdout, res.stdout + res.stderr
    assert "**partial run**: 0 of 1 shards done" in res.stdout and "GPU-hours: 0.0000" in res.stdout


def test_docs_list_the_preset_prices() -> None:
    readme = (REPO / "docs" / "tune-forecast.md").read_text()
    names = next(ln for ln in readme.splitlines() if ln.startswith("| `--gpu` |"))
    prices = next(ln for ln in readme.splitlines() if ln.startswith("| assumed $/GPU-hour |"))
    cells = [[c.strip() for c in ln.strip("|").split("|")[1:]] for ln in (names, prices)]
    assert dict(zip(cells[0], map(float, cells[1]), strict=True)) == GPU_HOUR_PRICES


def test_docs_show_the_report_table_with_every_column_it_prints() -> None:
    from batchinfer.rundir.stats import HEADER

    page = (REPO / "docs" / "tune-forecast.md").read_text()
    header = next(ln for ln in page.splitlines() if ln.startswith("| shard | rows |"))
    assert header == "| " + " | ".join(HEADER) + " |"
