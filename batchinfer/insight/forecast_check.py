"""`report` on a run made with a tune result: the forecast DIR/forecast.json recorded at submit or
run (tune/expected.py) beside what the run measured, as ratios measured / forecast."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

from batchinfer.rundir.forecast_record import read_record
from batchinfer.rundir.store import RunDir

# figure -> label; rows-proportional figures are scaled to the rows done in a partial run, rates not
FIGURES = {
    "gpu_hours": "GPU-hours",
    "output_tokens": "output tokens",
    "output_tokens_per_s": "output tok/s",
    "rows_per_s": "rows/s",
    "generate_seconds": "generation seconds",
}
RATES = {"output_tokens_per_s", "rows_per_s"}


@dataclass(frozen=True)
class Check:
    """One figure: the forecast (scaled to the rows done), the measured value and their ratio."""

    value: float
    low: float
    high: float
    measured: Optional[float]
    ratio: Optional[float]  # measured / forecast value: 1.0 is as forecast
    within: Optional[bool]  # measured inside the forecast's interval


def measured(tot: dict[str, Any], cost: dict[str, Any]) -> dict[str, Optional[float]]:
    """The run's own figures as the report counts them (totals over shards, cost's GPU-hours)."""
    gen = tot["seconds"]["generate"]
    return {
        "gpu_hours": cost["gpu_hours"],
        "output_tokens": float(tot["output_tokens"]),
        "output_tokens_per_s": tot["output_tokens"] / gen if gen else None,
        "rows_per_s": tot["rows_done"] / gen if gen else None,
        "generate_seconds": gen,
    }


def compare(run: RunDir, tot: dict[str, Any], cost: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The report's `forecast` object; None when the run has no recorded forecast."""
    rf = read_record(run.path)
    if rf is None:
        return None
    share = tot["rows_done"] / rf.rows if rf.rows and tot["rows_done"] < rf.rows else 1.0
    got = measured(tot, cost)
    figures = {}
    for name in FIGURES:
        f = rf.figures.get(name)
        if f is None:
            continue
        k = 1.0 if name in RATES else share
        value, low, high, m = f.value * k, f.low * k, f.high * k, got[name]
        figures[name] = asdict(
            Check(
                value=value,
                low=low,
                high=high,
                measured=m,
                ratio=m / value if m is not None and value else None,
                within=low <= m <= high if m is not None else None,
            )
        )
    return {
        "source": rf.source,
        "created": rf.created,
        "setting": rf.setting,
        "tuned_settings_used": rf.tuned_settings_used,
        "rows": rf.rows,
        "scaled_to_rows_done": share,
        "figures": figures,
    }


def _n(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:,.4g}"


def _ratio(r: float) -> str:
    """Two decimals where they say something (0.81, 1.20), else three significant digits."""
    return f"{r:.2f}" if 0.01 <= r < 1000 else f"{r:.3g}"


def forecast_lines(fc: Optional[dict[str, Any]]) -> list[str]:
    """The report's "Forecast and measured" section (no lines without a forecast)."""
    if not fc:
        return []
    lines = [
        "## Forecast and measured",
        "",
        f"Forecast from {fc['source']} (tune of {fc['created']}, setting {fc['setting']}) for {fc['rows']:,} rows; "
        "ratio = measured / forecast (1.00: as forecast); interval: the tune's 95% bootstrap interval.",
    ]
    if fc["scaled_to_rows_done"] < 1:
        lines.append(
            f"Partial run: the forecast scaled to the rows done ({fc['scaled_to_rows_done']:.1%}; rates not scaled)."
        )
    if not fc["tuned_settings_used"]:
        lines.append("The run did not use the tune's winning settings: the forecast is for those.")
    lines += ["", "| figure | forecast | interval | measured | ratio |", "|---|---:|---|---:|---:|"]
    for name, c in fc["figures"].items():
        ratio = "-" if c["ratio"] is None else _ratio(c["ratio"])
        lines.append(
            f"| {FIGURES[name]} | {_n(c['value'])} | {_n(c['low'])} .. {_n(c['high'])} | {_n(c['measured'])} | {ratio} |"
        )
    return lines
