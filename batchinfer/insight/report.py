"""`report`: the throughput table, charts and cost of a finished or partial run."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from batchinfer.rundir.stats import markdown_table, shard_stats, totals
from batchinfer.rundir.store import RunDir


def build_report(
    run: RunDir, price: Optional[float] = None, gpu: Optional[str] = None, watts: Optional[float] = None
) -> dict[str, Any]:
    """Per-shard stats, totals and cost of DIR as it is now (finished or partial); no Slurm calls."""
    from batchinfer.insight.cost import cost, gpus_per_task

    shards = shard_stats(run)
    tot = totals(shards)
    gpus = gpus_per_task(run.config, [s["device"] for s in shards])
    return {
        "dir": str(run.path),
        "partial": tot["shards_done"] < tot["shards"],
        "merged": run.output_path.exists(),
        "totals": tot,
        "cost": cost(tot, gpus, price=price, gpu=gpu, watts=watts),
        "shards": shards,
    }


def format_report(rep: dict[str, Any], charts: list[Path]) -> str:
    """report.md: what the run was, the table, the cost, the charts."""
    from batchinfer.insight.cost import cost_lines

    tot = rep["totals"]
    if rep["partial"]:
        state = (
            f"**partial run**: {tot['shards_done']} of {tot['shards']} shards done, {tot['rows_done']:,} of "
            f"{tot['rows']:,} rows committed; the figures cover committed rows only"
        )
    else:
        state = f"finished: {tot['shards']} shards, {tot['rows']:,} rows" + (
            "" if rep["merged"] else " (not merged yet)"
        )
    lines = [f"# batchinfer report: {rep['dir']}", "", state, "", *markdown_table(rep["shards"], tot), ""]
    lines += [
        "tok/s: tokens over generate seconds (one task while generating); total = prompt + output tokens. "
        "Prefix cache hits: prompt tokens vLLM served from its prefix cache.",
        "",
        "## Cost",
        "",
        *cost_lines(rep["cost"]),
    ]
    if charts:
        lines += ["", "## Charts", "", *(f"![{c.stem}]({c.name})" for c in charts)]
    return "\n".join(lines) + "\n"


def write_report(run: RunDir, **kw: Any) -> tuple[dict[str, Any], str]:
    """Write DIR/report/{report.md, report.json, *.png}; return the report and its markdown."""
    from batchinfer.insight.charts import write_charts
    from batchinfer.rundir.store import write_json

    rep = build_report(run, **kw)
    folder = run.path / "report"
    folder.mkdir(exist_ok=True)
    charts = write_charts(run, rep["shards"], folder)
    text = format_report(rep, charts)
    (folder / "report.md").write_text(text)
    write_json(folder / "report.json", dict(rep, charts=[str(c) for c in charts]))
    return rep, text
