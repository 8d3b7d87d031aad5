"""A start-up storm on the dev Slurm cluster: N array tasks (6) with `model.enforce_eager=false`
starting together on one shared vLLM cache folder (`cluster.cache_dir`), real vLLM, the tests' tiny
Llama. Not in CI.

Scenarios, each a `batchinfer submit` of N shards as N tasks of 1 CPU, all running at once:
- cold: a fresh cache folder. One task takes the cache lock and compiles; the others wait for it,
  then load what it wrote (engine/compile_cache.py).
- warm: the same folder again, a new run directory: every task finds the cache ready (what the
  tasks after the first wave of a large array see).
- private: a fresh folder with `cluster.cache_wait_s=0`: one task writes the shared cache, the
  others start at once on private caches and compile by themselves (as every task would without
  a shared cache, or with one per task).

Per task: how it used the cache (wrote / read / private, from BATCHINFER_CACHE_LOG), seconds it
waited for the lock, its engine's start-up (BATCHINFER_ENGINE_LOG), the compile part of it (between
vLLM's worker log lines around its compile) and the sum; from vLLM's log lines (tasks log vLLM at
INFO here) who saved an AOT artifact, loaded one or failed to; the files each wrote into the shared
cache (compiled kernels apart); and the check that the merged output has every row exactly once with its own
answer. The dev cluster is brought up with CPUS=N (the node advertises N CPUs; `config_overrides`)
so the N tasks run together on the 2 real cores, and put back as up.sh makes it by default at the
end (CPUS=nproc, as the tests bring it up).

Writes benchmarks/results/cache_storm.md, .json and .png.

usage: python benchmarks/cache_storm.py [--tasks 6] [--rows-per-task 16] [--scenarios cold,warm,private]
       [--out /tmp/cache-storm] [--results benchmarks/results]
Run it under the machine's heavy lock: flock /tmp/heavy.lock python benchmarks/cache_storm.py
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
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
sys.path.insert(0, str(REPO / "tests"))

from _common import machine  # noqa: E402
from support import tiny_model  # noqa: E402
from support.corpus import assert_exactly_once, assert_own_output, read_output, write_corpus  # noqa: E402
from support.slurm import cluster_overrides, use_dev_cluster, wait_until_idle  # noqa: E402

from batchinfer.faults import CACHE_LOG_ENV, ENGINE_LOG_ENV  # noqa: E402

SCENARIOS = {
    "cold": "fresh cache folder: one task compiles, the others wait and load",
    "warm": "the cold scenario's folder again: every task loads",
    "private": "fresh folder, cluster.cache_wait_s=0: one writes it, the others compile on private caches",
}
RELOAD = "Compiling model again due to a load failure"  # vLLM 0.32, compilation/decorators.py
# vLLM 0.32's CPU worker brackets its compile (and the warm-up run) with these lines (cpu_model_runner.py).
COMPILE_BEGIN, COMPILE_END = "Warming up model for the compilation", "Warming up done"
AOT_SAVED, AOT_LOADED = "saved AOT compiled function", "Directly load AOT compilation"
STAMP = re.compile(r"\) \w+ (\d\d-\d\d \d\d:\d\d:\d\d) ")  # "(Worker pid=1) INFO 12-06 21:05:04 [...]"


def snapshot(cache: Path) -> dict[str, int]:
    """Files of vLLM's cache folder (batchinfer's own lock and markers, Inductor's lock files left out)
    and their mtimes."""
    if not cache.is_dir():
        return {}
    return {
        str(p.relative_to(cache)): p.stat().st_mtime_ns
        for p in cache.rglob("*")
        if p.is_file() and p.parts[len(cache.parts)] != "batchinfer" and p.parent.name != "locks"
    }


def written(before: dict[str, int], after: dict[str, int], writer_at: float | None) -> dict[str, int]:
    """Files the scenario wrote (new or rewritten), by kind (compiled kernels .so, other) and by whom:
    up to the moment the writer's engine was ready, or after (the other tasks)."""
    out = {"kernels_writer": 0, "kernels_others": 0, "other_writer": 0, "other_others": 0}
    for path, mtime in after.items():
        if before.get(path) == mtime:
            continue
        who = "writer" if writer_at is not None and mtime / 1e9 <= writer_at else "others"
        out[f"{'kernels' if path.endswith('.so') else 'other'}_{who}"] += 1
    return out


def compile_phase(log: Path) -> dict[str, Any]:
    """From a task's log (vLLM at INFO): seconds between the worker's compile lines (vLLM's stamps are
    whole seconds), and how often it saved or loaded an AOT artifact or could not load one."""
    begin = end = None
    counts = {"aot_saved": 0, "aot_loaded": 0, "aot_load_failed": 0}
    for line in log.read_text(errors="replace").splitlines():
        m = STAMP.search(line)
        at = datetime.datetime.strptime(m.group(1), "%m-%d %H:%M:%S") if m else None
        if COMPILE_BEGIN in line and begin is None:
            begin = at
        elif COMPILE_END in line and end is None:
            end = at
        counts["aot_saved"] += AOT_SAVED in line
        counts["aot_loaded"] += AOT_LOADED in line
        counts["aot_load_failed"] += RELOAD in line
    seconds = (end - begin).total_seconds() if begin and end else None
    return {"compile_s": seconds, **counts}


def task_log(run_dir: Path, task: str) -> Path | None:
    """submitit's log of array task JOB_INDEX."""
    return next(iter(sorted((run_dir / "logs").rglob(f"{task}_*log.out"))), None)


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def submit(args: argparse.Namespace, name: str, corpus: Path, model: Path, cache: Path, *extra: str) -> Path:
    """One array of args.tasks tasks, all at once, on the cache folder; returns DIR."""
    run_dir = args.out / name
    logs = args.out / f"{name}-logs"
    logs.mkdir(parents=True, exist_ok=True)
    overrides = cluster_overrides(
        args.out,
        corpus,
        model,
        "model.enforce_eager=false",
        f"sharding.num_shards={args.tasks}",
        "cluster.cpus_per_task=1",
        f"cluster.array_parallelism={args.tasks}",
        "cluster.time=60",
        f"cluster.cache_dir={cache}",
        f"+cluster.env.{CACHE_LOG_ENV}={logs / 'cache.jsonl'}",
        f"+cluster.env.{ENGINE_LOG_ENV}={logs / 'engines.jsonl'}",
        "+cluster.env.VLLM_LOGGING_LEVEL=INFO",  # vLLM's own lines on who saved and who loaded
        "sampling.max_tokens=8",
        *extra,
        out=run_dir,
    )
    res = subprocess.run(
        [sys.executable, "-m", "batchinfer.cli", "submit", *overrides], capture_output=True, text=True, timeout=600
    )
    if res.returncode != 0:
        raise SystemExit(f"submit failed:\n{res.stdout}\n{res.stderr}")
    print(res.stdout.strip().splitlines()[0], flush=True)
    return run_dir


def measure(
    name: str, run_dir: Path, rows: list[dict[str, Any]], cache: Path, before: dict[str, int]
) -> dict[str, Any]:
    """Per task: role, wait, engine start; what the tasks wrote into the shared cache; vLLM's own
    reloads; the output checked."""
    logs = run_dir.parent / f"{name}-logs"
    out = read_output(run_dir)
    assert_exactly_once(out, rows)
    by_id = {r["id"]: r for r in rows}
    for r in out:
        assert r["error"] is None, r
        assert_own_output(r, by_id[r["id"]]["text"])
    engines = {e["pid"]: e for e in jsonl(logs / "engines.jsonl")}
    tasks = []
    for c in sorted(jsonl(logs / "cache.jsonl"), key=lambda c: c["slurm_job"] or ""):
        start = engines[c["pid"]]["seconds"]
        log = task_log(run_dir, c["slurm_job"])
        phase = (
            compile_phase(log) if log else {"compile_s": None, "aot_saved": 0, "aot_loaded": 0, "aot_load_failed": 0}
        )
        tasks.append(
            {
                "task": c["slurm_job"],
                "role": c["role"],
                "waited_s": c["waited_s"],
                "engine_start_s": start,
                "total_s": round(c["waited_s"] + start, 2),
                "began_at": c["at"] - start - c["waited_s"],  # when the task asked for its engine
                "private": c["root"] != str(cache),
                **phase,
            }
        )
    began = min(t["began_at"] for t in tasks)
    for t in tasks:
        t["began_s"] = round(t.pop("began_at") - began, 2)
    reasons: dict[str, int] = {}
    for f in (run_dir / "logs").rglob("*.out"):
        for line in f.read_text(errors="replace").splitlines():
            if RELOAD in line:
                reason = line.split("reason: ", 1)[-1].strip()
                reasons[reason] = reasons.get(reason, 0) + 1
    writer_at = next((c["at"] for c in jsonl(logs / "cache.jsonl") if c["role"] == "wrote"), None)
    return {
        "scenario": name,
        "rows": len(out),
        "tasks": tasks,
        "cache_files": written(before, snapshot(cache), writer_at),
        "reloads": reasons,  # vLLM could not load its AOT artifact, compiled again (from cached kernels)
    }


def summary(m: dict[str, Any]) -> dict[str, Any]:
    """The writer's (first) start against the others'."""
    first = [t for t in m["tasks"] if t["role"] == "wrote"]
    others = [t for t in m["tasks"] if t["role"] != "wrote"]

    def med(ts: list[dict[str, Any]], key: str) -> Any:
        return round(statistics.median(t[key] for t in ts), 1) if ts else None

    return {
        "first_engine_s": first[0]["engine_start_s"] if first else None,
        "first_compile_s": first[0]["compile_s"] if first else None,
        "others_compile_s": med(others, "compile_s") if all(t["compile_s"] is not None for t in others) else None,
        "others_wait_s": med(others, "waited_s"),
        "others_engine_s": med(others, "engine_start_s"),
        "others_total_s": med(others, "total_s"),
        "all_done_s": round(max(t["began_s"] + t["total_s"] for t in m["tasks"]), 1),
    }


def write_results(args: argparse.Namespace, results: list[dict[str, Any]], mach: dict[str, Any], cmd: str) -> None:
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "cache_storm.json").write_text(json.dumps({"machine": mach, "results": results}, indent=2) + "\n")
    bf16 = ", ".join(f for f, on in mach["flags"].items() if on) or "none"
    lines = [
        "# Start-up storm: N tasks starting together on one vLLM cache folder",
        "",
        f"{mach['cpu']}, {mach['cores']} cores (flags: {bf16}), {mach['mem_gb']} GB, "
        f"{', '.join(f'{k} {v}' for k, v in mach['versions'].items())}, {mach['date']}. The dev Slurm "
        f"cluster's one node advertised {args.tasks} CPUs, so the {args.tasks} tasks of 1 CPU each ran at "
        "once on the 2 real cores; the tests' tiny Llama, `model.enforce_eager=false`.",
        "",
        f"Command: `{cmd}`",
        "",
        "| scenario | what | first (writer): engine start s | first: compile s | others: waited s | "
        "others: engine start s | others: compile s | others: total s | all engines ready at s | shared "
        "cache: kernels (.so) written by the writer / by the others | other files by the writer / by the others |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in results:
        s, f = summary(m), m["cache_files"]
        first = s["first_engine_s"] if s["first_engine_s"] is not None else "-"
        first_c = s["first_compile_s"] if s["first_compile_s"] is not None else "-"
        lines.append(
            f"| {m['scenario']} | {SCENARIOS[m['scenario']]} | {first} | {first_c} | {s['others_wait_s']} | "
            f"{s['others_engine_s']} | {s['others_compile_s']} | {s['others_total_s']} | {s['all_done_s']} | "
            f"{f['kernels_writer']} / {f['kernels_others']} | {f['other_writer']} / {f['other_others']} |"
        )
    reloads = {r: n for m in results for r, n in m["reloads"].items()}
    lines += [
        "",
        "Engine start: from asking vLLM for the engine to the engine ready (process starts, imports, "
        "weights, compile, KV cache). Compile: the part between vLLM's worker lines `Warming up model for the "
        "compilation` and `Warming up done` (whole seconds): what the cache can save. "
        "Others: the median over the tasks that did not write the cache. All engines ready at: seconds from "
        "the first task asking for its engine to the last engine ready. Shared cache: files of the cache "
        "folder the scenario created or rewrote, up to the moment the writer's engine was ready or after "
        "(Inductor's own lock files left out). Every scenario's merged output had every row exactly once, "
        "each with its own answer.",
        "",
        "vLLM's log lines `Compiling model again due to a load failure` (it could not load the AOT artifact "
        "it had saved, and traced again, taking the compiled kernels from the cache): "
        + (", ".join(f"{n} x `{r}`" for r, n in reloads.items()) or "none"),
        "",
        "Per task:",
        "",
        "| scenario | task | role | began s | waited s | engine start s | compile s | total s | AOT artifact "
        "saved / loaded / failed to load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for m in results:
        for t in m["tasks"]:
            lines.append(
                f"| {m['scenario']} | {t['task']} | {t['role']} | {t['began_s']} | {t['waited_s']} | "
                f"{t['engine_start_s']} | {t['compile_s']} | {t['total_s']} | {t['aot_saved']} / "
                f"{t['aot_loaded']} / {t['aot_load_failed']} |"
            )
    (args.results / "cache_storm.md").write_text("\n".join(lines) + "\n")
    plot(results, args.results / "cache_storm.png")


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Per scenario, per task: a bar from when it asked for its engine, waiting then starting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"wrote": "tab:red", "read": "tab:green"}
    fig, axes = plt.subplots(len(results), 1, figsize=(8, 1.2 + 0.45 * sum(len(m["tasks"]) for m in results)))
    axes = axes if len(results) > 1 else [axes]
    span = max(t["began_s"] + t["total_s"] for m in results for t in m["tasks"])
    for ax, m in zip(axes, results, strict=True):
        for i, t in enumerate(m["tasks"]):
            ax.barh(i, t["waited_s"], left=t["began_s"], color="lightgrey")
            ax.barh(i, t["engine_start_s"], left=t["began_s"] + t["waited_s"], color=colors.get(t["role"], "tab:blue"))
            ax.text(t["began_s"] + t["total_s"] + span * 0.01, i, t["role"], va="center", fontsize=8)
        ax.set_yticks(range(len(m["tasks"])), [t["task"].rsplit("_", 1)[-1] for t in m["tasks"]])
        ax.set_xlim(0, span * 1.18)
        ax.invert_yaxis()
        ax.set_title(f"{m['scenario']}: {SCENARIOS[m['scenario']]}", fontsize=9)
        ax.set_ylabel("task")
    axes[-1].set_xlabel(
        "seconds (grey: waiting for the cache lock; red: wrote the cache; green: loaded it; blue: private)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=6)
    ap.add_argument("--rows-per-task", type=int, default=16)
    ap.add_argument("--scenarios", default="cold,warm,private")
    ap.add_argument("--out", type=Path, default=Path("/tmp/cache-storm"))
    ap.add_argument("--results", type=Path, default=HERE / "results")
    args = ap.parse_args()
    names = args.scenarios.split(",")
    if unknown := set(names) - set(SCENARIOS):
        raise SystemExit(f"unknown scenarios {sorted(unknown)}; choose from {', '.join(SCENARIOS)}")
    if "warm" in names and "cold" not in names:
        raise SystemExit("warm reuses the cold scenario's cache folder: run cold too")
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    cmd = "python benchmarks/cache_storm.py " + " ".join(sys.argv[1:])
    mach = machine()
    use_dev_cluster(CPUS=str(args.tasks))
    try:
        model = tiny_model.build(args.out / "tiny-llama")
        corpus = args.out / "corpus.jsonl"
        rows = write_corpus(corpus, args.tasks * args.rows_per_task, seed=44)
        results = []
        caches = {"cold": args.out / "cache-shared", "warm": args.out / "cache-shared", "private": args.out / "cache-p"}
        for name in names:
            extra = ["cluster.cache_wait_s=0"] if name == "private" else []
            t0 = time.monotonic()
            before = snapshot(caches[name])
            run_dir = submit(args, name, corpus, model, caches[name], *extra)
            wait_until_idle(run_dir, timeout=3600)
            m = measure(name, run_dir, rows, caches[name], before)
            m["wall_s"] = round(time.monotonic() - t0, 1)
            results.append(m)
            print(json.dumps({"scenario": name, **summary(m), "wall_s": m["wall_s"]}), flush=True)
    finally:
        use_dev_cluster()  # the dev cluster as up.sh makes it by default (CPUS=nproc), as the tests use it
        node = subprocess.run(["scontrol", "show", "node", "-o"], capture_output=True, text=True).stdout
        print(f"dev cluster put back: {' '.join(w for w in node.split() if w.startswith(('NodeName=', 'CPUTot=')))}")
    write_results(args, results, mach, cmd)
    print(f"wrote {args.results / 'cache_storm.md'}")


if __name__ == "__main__":
    main()
