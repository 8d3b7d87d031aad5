"""What a tune leaves in its folder: the table (tune.md), the plot (tune.png), the winning
overrides as a Hydra config group (conf/tuned/best.yaml) and everything as tune.json."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from batchinfer.redaction import record_json, record_yaml
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
    body = record_yaml(OmegaConf.to_container(OmegaConf.from_dotlist(dotlist))) if overrides else "{}\n"
    # submit and run find the tune result (its fingerprint and forecast) from this line
    source = f"{TUNE_RESULT_LINE}{(folder / 'tune.json').resolve()}\n"
    path.write_text(
        "# @package _global_\n# Written by `batchinfer tune`: the fastest settings; none changes outputs.\n"
        + source
        + body,
        encoding="utf-8",
    )
    return path


def write_json(folder: Path, result: dict[str, Any]) -> Path:
    """tune.json, written whole under a temporary name and renamed."""
    path = folder / "tune.json"
    tmp = folder / ".tune.json.tmp"
    tmp.write_text(record_json(result, indent=2, default=str) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path
