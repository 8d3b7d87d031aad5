"""`report`: the throughput table, charts and cost of a finished or partial run."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, TypedDict

from batchinfer.insight import forecast_check
from batchinfer.insight.adapters import AdapterRow, adapter_lines, adapter_rows
from batchinfer.insight.cost import CostRecord
from batchinfer.insight.image_counts import ImageCounts, image_counts, image_lines
from batchinfer.insight.passes import report_lines, rows_per_pass
from batchinfer.redaction import redact_text
from batchinfer.rundir.stats import ShardStats, Totals, markdown_table, reused_line, shard_stats, totals
from batchinfer.rundir.store import RunDir


class EngineRow(TypedDict):
    """One engine index (engine k of each task) in the report's per-engine table (engine_table)."""

    engine: int
    devices: list[str]
    shards: int
    rows_done: int
    output_tokens: int
    generate_seconds: float
    rows_per_s: Optional[float]
    output_tokens_per_s: Optional[float]


class Report(TypedDict):
    """report.json (without its `charts`) and `report --json`: build_report."""

    dir: str
    partial: bool
    merged: bool
    passes: Optional[dict[str, int]]  # rows of the output per `batchinfer redo` pass (None: no pass)
    totals: Totals
    cost: CostRecord
    engines: Optional[list[EngineRow]]
    adapters: Optional[list[AdapterRow]]  # committed rows and tokens per LoRA adapter (None: no adapters)
    images: Optional[ImageCounts]  # images of the committed rows (None: a run without images)
    shards: list[ShardStats]
    forecast: Any  # forecast_check.compare's (None: the run recorded no forecast)


def build_report(
    run: RunDir, price: Optional[float] = None, gpu: Optional[str] = None, watts: Optional[float] = None
) -> Report:
    """Per-shard stats, totals and cost of DIR as it is now (finished or partial); no Slurm calls."""
    from batchinfer.insight.cost import cost, engine_gpu_seconds, gpus_per_task, task_nodes
    from batchinfer.rundir.progress import engine_record

    shards = shard_stats(run)
    for s in shards:
        s["engine"] = engine_record(s["engine"])
    tot = totals(shards)
    gpus = gpus_per_task(run.recorded_config, [s["device"] for s in shards])
    gpu_seconds, layouts = engine_gpu_seconds(run.recorded_config, gpus, shards)
    rep: Report = {  # type: ignore[typeddict-item]  # its forecast follows
        "dir": str(run.path),
        "partial": tot["shards_done"] < tot["shards"],
        "merged": run.output_path.exists(),
        "passes": rows_per_pass(run),  # rows of the output per `batchinfer redo` pass (None: no pass)
        "totals": tot,
        "cost": cost(
            tot,
            gpus,
            price=price,
            gpu=gpu,
            watts=watts,
            gpu_seconds=gpu_seconds,
            layouts=layouts,
            nodes=task_nodes(run.recorded_config),
        ),
        "engines": engine_table(shards),
        "adapters": adapter_rows(run),
        "images": image_counts(run),
        "shards": shards,
    }
    rep["forecast"] = forecast_check.compare(run, tot, rep["cost"])  # None: the run recorded no forecast
    return rep


def engine_table(shards: list[ShardStats]) -> Optional[list[EngineRow]]:
    """Per engine index (engine k of a task's N): shards, rows, generate seconds and rates; None unless
    some shard ran in a task of several engines. A shard without an engine record counts as engine 0."""
    if not any(s["engine"] and s["engine"]["of"] > 1 for s in shards):
        return None
    rows: dict[int, EngineRow] = {}
    for s in shards:
        if not s["engine"] and not (s["rows_done"] or any(s["seconds"].values())):
            continue  # not started: no engine ran it
        index = s["engine"]["index"] if s["engine"] else 0
        r = rows.setdefault(
            index,
            {  # type: ignore[typeddict-item]  # its rates follow
                "engine": index,
                "devices": [],
                "shards": 0,
                "rows_done": 0,
                "output_tokens": 0,
                "generate_seconds": 0.0,
            },
        )
        devices = s["engine"] and s["engine"]["devices"]
        if devices and devices not in r["devices"]:
            r["devices"].append(devices)
        r["shards"] += 1
        r["rows_done"] += s["rows_done"]
        r["output_tokens"] += s["output_tokens"]
        r["generate_seconds"] += s["seconds"]["generate"]
    for r in rows.values():
        gen = r["generate_seconds"]
        r["rows_per_s"] = round(r["rows_done"] / gen, 2) if gen else None
        r["output_tokens_per_s"] = round(r["output_tokens"] / gen, 2) if gen else None
    return [rows[k] for k in sorted(rows)]


def engine_lines(engines: list[EngineRow]) -> list[str]:
    """The per-engine table of report.md."""
    lines = [
        "## Engines",
        "",
        "Each array task ran several engines (cluster.engines_per_task), each taking the task's shards one at a "
        "time; shards by the engine that ran them (engine k of each task). tok/s and rows/s over generate seconds.",
        "",
        "| engine | devices | shards | rows | generate s | rows/s | output tok/s |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in engines:
        devices = r["devices"][:3] + (["…"] if len(r["devices"]) > 3 else [])
        lines.append(
            f"| {r['engine']} | {'; '.join(devices) or '-'} | {r['shards']:,} | {r['rows_done']:,} | "
            f"{r['generate_seconds']:,.1f} | {_num(r['rows_per_s'])} | {_num(r['output_tokens_per_s'])} |"
        )
    return lines


def _num(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:,.1f}"


def format_report(rep: Report, charts: list[Path]) -> str:
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
    lines += reused_line(tot)
    lines += report_lines(rep.get("passes"))
    lines += [
        f"tok/s: tokens over generate seconds (one {'engine' if rep.get('engines') else 'task'} while generating); "
        "total = prompt + output tokens. "
        "Prefix cache hits: prompt tokens vLLM served from its prefix cache.",
        "",
        *([*engine_lines(rep["engines"]), ""] if rep.get("engines") else []),
        *(
            [*adapter_lines(rep["adapters"], [s.get("adapter_loads") for s in rep["shards"]]), ""]
            if rep.get("adapters")
            else []
        ),
        *([*image_lines(rep["images"]), ""] if rep.get("images") else []),
        "## Cost",
        "",
        *cost_lines(rep["cost"]),
        *(["", *forecast_check.forecast_lines(rep["forecast"])] if rep.get("forecast") else []),
    ]
    if charts:
        lines += ["", "## Charts", "", *(f"![{c.stem}]({c.name})" for c in charts)]
    return "\n".join(lines) + "\n"


def write_report(run: RunDir, **kw: Any) -> tuple[Report, str]:
    """Write DIR/report/{report.md, report.json, *.png}; return the report and its markdown."""
    from batchinfer.durable import write_json
    from batchinfer.insight.charts import write_charts

    rep = build_report(run, **kw)
    folder = run.path / "report"
    folder.mkdir(exist_ok=True)
    charts = write_charts(run, rep["shards"], folder)
    text = format_report(rep, charts)
    (folder / "report.md").write_text(redact_text(text))
    write_json(folder / "report.json", dict(rep, charts=[str(c) for c in charts]))
    return rep, text
