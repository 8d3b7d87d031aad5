"""What a tune leaves in its folder: the table (tune.md), the plot (tune.png), the winning
overrides as a Hydra config group (conf/tuned/best.yaml) and everything as tune.json."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from batchinfer.durable import write_record
from batchinfer.redaction import exact_yaml, record_json
from batchinfer.tune.halving import Outcome

GROUP, OPTION = "tuned", "best"
TUNE_RESULT_LINE = "# tune result: "


def _num(x: Optional[float], digits: int = 1) -> str:
    return "" if x is None else f"{x:,.{digits}f}"


def setting_record(o: Outcome) -> dict[str, Any]:
    """One setting as tune.json and --json give it."""
    rungs = o.rungs
    gen = sum(r.generate_seconds for r in rungs)
    hits = [r.prefix_cache_hit_rate for r in rungs if r.prefix_cache_hit_rate is not None]
    peaks = [r.peak_memory_mb for r in rungs if r.peak_memory_mb is not None]
    return {
        "name": o.setting.name,
        "overrides": o.setting.override_strings(),
        "changes_outputs": o.setting.changes_outputs,
        "startup_seconds": o.startup_seconds,
        "engines": o.engines,  # side by side in its task; the rates below are the task's
        "rungs": len(rungs),
        "rows": sum(r.rows for r in rungs),
        "generate_seconds": round(gen, 3),
        "output_tokens_per_s": round(o.output_tokens_per_s, 2) if o.output_tokens_per_s is not None else None,
        "rows_per_s": round(o.rows_per_s, 3) if o.rows_per_s is not None else None,
        "prefix_cache_hit_rate": round(sum(hits) / len(hits), 4) if hits else None,
        "peak_memory_mb": max(peaks) if peaks else None,
        "failure": o.failure,
    }


def table(records: list[dict[str, Any]], winner: Optional[str]) -> str:
    """The settings as a markdown table; the winner marked *, output-changing settings marked †."""
    head = "| setting | start-up s | output tok/s | rows/s | rungs (rows) | prefix-cache hits | peak RSS MB | failure |"
    lines = [head, "|" + "---|" * 8]
    for r in records:
        mark = (" *" if r["name"] == winner else "") + (" †" if r["changes_outputs"] else "")
        hit = f"{r['prefix_cache_hit_rate']:.0%}" if r["prefix_cache_hit_rate"] is not None else ""
        lines.append(
            f"| {r['name']}{mark} | {_num(r['startup_seconds'])} | {_num(r['output_tokens_per_s'])} | "
            f"{_num(r['rows_per_s'], 2)} | {r['rungs']} ({r['rows']}) | {hit} | {_num(r['peak_memory_mb'], 0)} | "
            f"{r['failure'] or ''} |"
        )
    lines.append("")
    lines.append(
        "* the winner (fastest at the highest rung reached); † changes outputs: never chosen, try it yourself; "
        "rates are a task's, all its engines together"
    )
    return "\n".join(lines)


def plot(records: list[dict[str, Any]], winner: Optional[str], path: Path) -> bool:
    """Steady output tok/s (rows/s when nothing is generated) per setting; failures drawn as 0."""
    if not records:
        return False
    import matplotlib

    matplotlib.use("Agg")  # files only: login nodes have no display
    import matplotlib.pyplot as plt

    tokens = any(r["output_tokens_per_s"] for r in records)
    key = "output_tokens_per_s" if tokens else "rows_per_s"
    values = [r[key] or 0.0 for r in records]
    colors = ["#43a047" if r["name"] == winner else "#e53935" if r["failure"] else "#1e88e5" for r in records]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(records) + 1.5))
    ax.barh([r["name"] for r in records], values, color=colors)
    for y, r in enumerate(records):
        if r["failure"]:
            ax.text(0, y, "  failed: " + r["failure"][:60], va="center", fontsize="small")
    ax.invert_yaxis()
    ax.set(xlabel="output tokens/s (steady)" if tokens else "rows/s (steady)")
    ax.set_title("Steady rate per setting (green: winner, red: failed)", fontsize="medium")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def write_group(folder: Path, overrides: list[str]) -> Path:
    """conf/tuned/best.yaml: the winning overrides as a global config group, so that
    `run|submit --config-dir TUNE/conf +tuned=best` takes them as they are."""
    from omegaconf import OmegaConf

    path = folder / "conf" / GROUP / f"{OPTION}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    dotlist = [o.lstrip("+") for o in overrides]  # a command line's `++key=value` is `key: value` here
    # read back by run and submit: exactly what runs but a secret-named key's value (K11: an env.NAME
    # value was struck or rewritten to a reference as text)
    body = exact_yaml(OmegaConf.to_container(OmegaConf.from_dotlist(dotlist))) if overrides else "{}\n"
    # submit and run find the tune result (its fingerprint and forecast) from this line
    source = f"{TUNE_RESULT_LINE}{(folder / 'tune.json').resolve()}\n"
    # through the one record writer: owner-only when it marks a secret's place (attack42b K6)
    write_record(
        path,
        "# @package _global_\n# Written by `batchinfer tune`: the fastest settings; none changes outputs.\n"
        + source
        + body,
    )
    return path


def write_json(folder: Path, result: dict[str, Any]) -> Path:
    """tune.json, written whole (durable.write_record: owner-only when it marks a secret's place)."""
    path = folder / "tune.json"
    write_record(path, record_json(result, indent=2, default=str) + "\n")
    return path


def _fig(name: str, f: dict[str, float], unit: str = "", scale: float = 1.0) -> str:
    shown = [f"{f[k] * scale:,.4g}" for k in ("value", "low", "high")]
    return f"  {name:<16} {shown[0]:>12}{unit}  ({shown[1]} .. {shown[2]})"


def format_result(r: dict[str, Any]) -> str:
    """The tune result for people: sample, table, output lengths, winner, forecast."""
    s, o = r["sample"], r["output_lengths"]
    lines = [
        f"pilot    {s['pilot_rows']} of {s['rows']:,} rows (seed {s['seed']}); prompt {s['length_unit']} "
        f"p10/p50/p90 {s['pilot_length_p10_p50_p90']} (corpus {s['corpus_length_p10_p50_p90']}); repeated "
        f"prompts {s['pilot_duplicate_share']:.1%} (corpus {s['corpus_duplicate_share']:.1%})",
        "",
        table(r["settings"], r["best"]["name"]),
        "",
        f"output tokens per row (pilot, {o['rows']} rows): mean {o['mean']}, p50 {o['p50']}, p90 {o['p90']}; "
        f"stopped at max_tokens: {o['share_at_max_tokens']:.1%}",
    ]
    if o["share_at_max_tokens"] > 0.05:
        lines.append("  many rows stop at max_tokens: raise sampling.max_tokens if their answers are cut short")
    b = r["best"]
    if b["name"] is None:
        lines.append("no setting finished: see the failures above and the trials' logs in " + r["folder"])
        return "\n".join(lines)
    choice = r.get("choice") or {}
    lines.append(f"best     {b['name']}" + ("" if b["overrides"] else " (the config as composed)"))
    if choice.get("reason"):
        lines.append(f"why      {choice['reason']}")
    lines.append(f"use      batchinfer run|submit {b['use']} <your overrides>")
    f = r["forecast"]
    model = r.get("forecast_model") or {}
    if f:
        sd = model.get("speed_sd")
        whole = s.get("pilot_is_corpus", False)
        sd_note = f" (sd {sd:.0%})" if sd else ""
        over = f"the speed's noise{sd_note}" if whole else f"the pilot's output lengths and the speed's noise{sd_note}"
        lines.append(f"forecast for {s['rows']:,} rows (95% interval over {over}):")
        lines.append(_fig("prompt tokens", f["prompt_tokens"]))
        measured = "  measured: the pilot ran the whole corpus" if whole else ""
        lines.append(_fig("output tokens", f["output_tokens"]) + measured)
        lines.append(_fig("generate hours", f["generate_seconds"], " h", 1 / 3600))
        lines.append(_fig("engine starts", f["engine_starts"]))
        lines.append(_fig("GPU-hours", f["gpu_hours"], " h"))
        lines.append(_fig("wall time", f["wall_seconds"], " h", 1 / 3600))
        if "cost_usd" in f:
            lines.append(_fig("cost", f["cost_usd"], " USD"))
        if model.get("note"):
            by = f" by {model['model']}" if model.get("model") else ""
            lines.append(f"  generate hours{by}: {model['note']}; start-up, merge and queueing not included")
    return "\n".join(lines)
