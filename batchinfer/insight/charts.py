"""PNG charts of a run: tok/s per shard over time, time split per shard, prompt/output lengths."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from batchinfer.rundir.progress import SeriesPoint
from batchinfer.rundir.stats import PHASES, ShardStats
from batchinfer.rundir.store import RunDir
from batchinfer.rundir.tables import read_table

log = logging.getLogger("batchinfer")
LEGEND_MAX = 12  # shards named in a legend; more are drawn unnamed
PHASE_COLORS = {"startup": "#9e9e9e", "prepare": "#ffb74d", "generate": "#1e88e5", "commit": "#43a047"}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: login nodes have no display
    import matplotlib.pyplot as plt

    return plt


def rate_steps(series: list[SeriesPoint], t0: float, window: float) -> tuple[list[float], list[float]]:
    """(minutes since t0, output tok/s) as steps over windows of at least `window` seconds: requests
    finish in bursts (a batch ends together), so the rate between two close commits means little."""
    cuts = [series[0]]
    for b in series[1:]:
        if b["t"] - cuts[-1]["t"] >= window:
            cuts.append(b)
    if cuts[-1] is not series[-1]:  # a short tail joins the window before it
        if len(cuts) > 1:
            cuts[-1] = series[-1]
        else:
            cuts.append(series[-1])
    xs: list[float] = []
    ys: list[float] = []
    for a, b in zip(cuts, cuts[1:], strict=False):
        if b["t"] > a["t"]:
            xs += [(a["t"] - t0) / 60, (b["t"] - t0) / 60]
            ys += [(b["output_tokens"] - a["output_tokens"]) / (b["t"] - a["t"])] * 2
    return xs, ys


def throughput_chart(shards: list[ShardStats], path: Path) -> bool:
    """Output tok/s of each shard over wall-clock time; False when no shard has two points."""
    with_series = [s for s in shards if len(s["series"]) > 1]
    if not with_series:
        return False
    plt = _pyplot()
    t0 = min(s["series"][0]["t"] for s in with_series)
    window = (max(s["series"][-1]["t"] for s in with_series) - t0) / 60  # ~60 steps across the run
    fig, ax = plt.subplots(figsize=(8, 4))
    for s in with_series:
        xs, ys = rate_steps(s["series"], t0, window)
        label = f"shard {s['shard']}" if len(with_series) <= LEGEND_MAX else None
        ax.plot(xs, ys, linewidth=1.2, label=label)
    ax.set(xlabel="minutes since the first shard started generating", ylabel="output tokens/s")
    ax.set_title("Output tokens/s per shard (between commits at least a 60th of the run apart)")
    ax.set_ylim(bottom=0)
    if len(with_series) <= LEGEND_MAX:
        ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def time_split_chart(shards: list[ShardStats], path: Path) -> bool:
    """Stacked bars of each shard's seconds in start-up / prepare / generate / commit."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    names = [str(s["shard"]) for s in shards]
    bottom = [0.0] * len(shards)
    for phase in PHASES:
        values = [s["seconds"][phase] for s in shards]
        ax.bar(names, values, bottom=bottom, label=phase.replace("startup", "start-up"), color=PHASE_COLORS[phase])
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set(xlabel="shard", ylabel="seconds")
    ax.set_title("Where each shard's time went")
    ax.legend(fontsize="small")
    if len(shards) > 40:
        ax.set_xticks([])
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def token_lengths(run: RunDir) -> tuple[pa.Table, str]:
    """prompt_tokens and output_tokens of every committed row, and where they were read from: the
    merged output when it is Parquet or JSONL, else the shards' parts."""
    columns = [c for c in ("prompt_tokens", "output_tokens") if c in run.schema.names]  # pooling: no output
    files = sorted(run.output_path.glob("output-*")) if run.output_path.is_dir() else [run.output_path]
    if run.output_format in ("parquet", "jsonl") and all(f.is_file() for f in files):
        return pa.concat_tables([read_table(f, run.schema, columns) for f in files]), "merged output"
    return pa.concat_tables([run.shard_folder(s.index).read_rows(columns=columns) for s in run.shards()]), "parts"


def _bins(values: list[int]) -> Any:
    """One bin per token count when few counts occur (short labels), else 40."""
    if values and max(values) - min(values) < 40:
        return [v - 0.5 for v in range(min(values), max(values) + 2)]
    return 40


def lengths_chart(lengths: pa.Table, source: str, path: Path) -> bool:
    """Histograms of prompt and output tokens per row; False when no row has them."""
    values = {c: pc.drop_null(lengths.column(c)).to_pylist() for c in lengths.column_names}
    if not any(values.values()):
        return False
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(values), figsize=(4 * len(values), 3.5), squeeze=False)
    for ax, (col, vals) in zip(axes[0], values.items(), strict=True):
        ax.hist(vals, bins=_bins(vals), color="#1e88e5")
        ax.set(xlabel=col.replace("_", " ") + " per row", ylabel="rows")
    fig.suptitle(f"Token lengths ({len(lengths):,} rows, from the {source})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def write_charts(run: RunDir, shards: list[ShardStats], folder: Path) -> list[Path]:
    """Every chart that has data, as PNG files in folder; returns the files written (none without matplotlib)."""
    try:
        _pyplot()
    except ImportError:
        log.warning("no charts: matplotlib is not installed (pip install 'batchinfer[report]')")
        return []
    lengths, source = token_lengths(run)
    charts = [
        (throughput_chart, (shards,), "throughput.png"),
        (time_split_chart, (shards,), "time-split.png"),
        (lengths_chart, (lengths, source), "lengths.png"),
    ]
    return [folder / name for draw, args, name in charts if draw(*args, folder / name)]
