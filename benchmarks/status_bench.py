"""`batchinfer status` of a 10,000-shard run (target: under 3 s), against fake sacct/squeue.

Builds a run directory as a real submission leaves it: a real `prepare` of a tiny corpus with
sharding.num_shards=N, DONE.json / progress.json records for a mix of shards (done, running,
failed with and without progress, pending), DIR/jobs.jsonl with `--arrays` arrays of N/arrays
one-shard tasks, a log folder of 4 files per task as submitit names them (40,000 at N=10,000),
and fake `sacct` / `squeue` on PATH printing N lines each. Then times the real CLI,
`python -m batchinfer.cli status DIR`, in a subprocess (a warm-up run, then the median of
`--repeats`), with its peak RSS; `--old PATH` times a checkout of another commit the same way
(its code first on PYTHONPATH) and checks both print the same table.

usage: python benchmarks/status_bench.py [--shards 10000] [--arrays 10] [--repeats 3]
           [--old /tmp/status-old] [--out benchmarks/results/status.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SERIES_POINTS = 20  # one per commit: a 10K-row shard committed every 500 rows
OTHER_JOBS = "bi-other-run"  # squeue also lists this user's jobs of another run


def progress_record(index: int, rows: int, done: int, failed: bool) -> dict[str, Any]:
    """A progress.json as the worker writes it (with_rates fields, series, holder)."""
    gen = 3.0 * done + 1.0
    out_tokens, prompt_tokens = 24 * done, 40 * done
    return {
        "shard": index,
        "rows_total": rows,
        "rows_done": done,
        "parts": SERIES_POINTS if done else 0,
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "errors": {"engine_crash": 1} if failed else {},
        "attempts": 2 if failed else 1,
        "failures": 1 if failed else 0,
        "failures_by_job": {"1000": 1} if failed else {},
        "suspects": {},
        "seconds": {"startup": 40.0, "prepare": 1.5, "generate": gen, "commit": 0.4},
        "prefix_cache": {"hits": prompt_tokens // 2, "queries": prompt_tokens},
        "series": [
            {
                "t": 1.7e9 + 30.0 * k,
                "rows_done": done * k // SERIES_POINTS,
                "output_tokens": out_tokens * k // SERIES_POINTS,
            }
            for k in range(1, SERIES_POINTS + 1)
        ],
        "output_tokens_per_s": round(out_tokens / gen, 2),
        "total_tokens_per_s": round((prompt_tokens + out_tokens) / gen, 2),
        "prefix_cache_hit_rate": 0.5 if prompt_tokens else None,
        "updated": 1.7e9 + 30.0 * SERIES_POINTS + index,
        "holder": {"host": f"gpu{index % 64:03d}", "pid": 4242, "job": f"1000_{index}"},
        **({"last_error": "EngineDeadError: engine core process died (exit code -9)"} if failed else {}),
    }


def done_record(index: int, rows: int) -> dict[str, Any]:
    """A DONE.json: the last progress record plus what reproduces the rows."""
    return {
        **progress_record(index, rows, rows, False),
        "finished": 1.7e9 + 700.0 + index,
        "model": {"path": "/models/Qwen2.5-7B-Instruct", "revision": None, "dtype": "bfloat16"},
        "quantization": {"method": None, "kv_cache_dtype": "auto"},
        "sampling": {"temperature": 0.0, "top_p": 1.0, "max_tokens": 64, "seed": 0, "n": 1},
        "prompt": {"template": "Label this text: {text}", "system": None, "chat": True, "labels": None},
        "host": f"gpu{index % 64:03d}",
        "device": "NVIDIA H100 80GB HBM3",
        "versions": {"batchinfer": "0.2.0", "vllm": "0.8.5", "torch": "2.6.0", "transformers": "4.51.3"},
    }


ERR_LOG = "".join(
    f"INFO 05-01 12:00:{k:02d} [engine.py:310] Avg prompt throughput: 900.0 tokens/s\n" for k in range(20)
)
TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "/opt/venv/lib/python3.11/site-packages/vllm/v1/engine/core_client.py", line 640, in get_output\n'
    "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace for the root cause.\n"
    "slurmstepd: error: Detected 1 oom_kill event in StepId={job}.0. Some of the step tasks have been OOM Killed.\n"
)


def build(root: Path, shards: int, arrays: int) -> tuple[Path, Path, dict[str, int]]:
    """(run directory, folder of the fake Slurm commands, counts of what was written)."""
    from batchinfer.config.compose import compose
    from batchinfer.rundir.prepare import prepare

    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"doc-{i:08d}", "text": f"row {i}"}) + "\n" for i in range(2 * shards)))
    model = root / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    ov = [
        f"input.path={corpus}",
        "input.id_column=id",
        f"model.path={model}",
        f"sharding.num_shards={shards}",
        f"output.dir={root / 'run'}",
        "cluster=slurm",
    ]
    run = prepare(compose(ov))
    logs = run.logs_dir / "submission-000"
    logs.mkdir(parents=True)
    per_array = -(-shards // arrays)
    lines: list[dict[str, Any]] = [{"submission": 0, "time": 1.7e9, "folder": str(logs), "name": "bi-bench-0"}]
    sacct, squeue = [], []
    plan = run.shards()
    counts = {"done": 0, "running": 0, "failed_after_commit": 0, "failed_before_commit": 0, "pending": 0}
    counts["log_files"] = 0
    for a in range(arrays):
        job = str(1000 + a)
        tasks = {str(t): [a * per_array + t] for t in range(per_array) if a * per_array + t < shards}
        lines.append({"submission": 0, "array": a, "job_id": job, "tasks": tasks})
        (logs / f"{job}_submission.sh").write_text("#!/bin/bash\n#SBATCH --array=0-999%1000\n")
        for t, (shard,) in tasks.items():
            task, kind, sdir = f"{job}_{t}", shard % 10, run.shard_dir(shard)
            rows = plan[shard].rows
            if kind <= 3:
                state, slurm_state = "done", "COMPLETED"
                sdir.mkdir(parents=True)
                (sdir / "DONE.json").write_text(json.dumps(done_record(shard, rows), indent=2, sort_keys=True) + "\n")
            elif kind <= 5:
                state, slurm_state = "running", "RUNNING"
                sdir.mkdir(parents=True)
                record = progress_record(shard, rows, 1, False)
                (sdir / "progress.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
            elif kind == 6:  # failed after committing rows
                state, slurm_state = "failed_after_commit", "FAILED"
                sdir.mkdir(parents=True)
                record = progress_record(shard, rows, 1, True)
                (sdir / "progress.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
            elif kind == 7:  # failed before its first commit: only the log says why
                state, slurm_state = "failed_before_commit", "OUT_OF_MEMORY"
            else:
                state, slurm_state = "pending", "PENDING"
            counts[state] += 1
            sacct.append(f"{task}|{slurm_state}")
            if slurm_state in ("RUNNING", "PENDING"):
                squeue.append(f"{task}|{job}|{slurm_state}|bi-bench-0")
            err = ERR_LOG + (TRACEBACK.format(job=task) if state.startswith("failed") else "")
            (logs / f"{task}_0_log.err").write_text(err)
            (logs / f"{task}_0_log.out").write_text(f"submitit INFO: Starting with JobEnvironment(job_id={task})\n")
            (logs / f"{task}_submitted.pkl").write_bytes(b"\x80\x05" + bytes(120))
            (logs / f"{task}_0_result.pkl").write_bytes(b"\x80\x05" + bytes(60))
            counts["log_files"] += 4
    lines.append({"submission": 0, "merge": str(1000 + arrays)})
    (run.path / "jobs.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    sacct.append(f"{1000 + arrays}|PENDING")
    # this user's jobs of another run fill squeue to as many lines as there are shards
    squeue += [f"9000_{i}|9000|PENDING|{OTHER_JOBS}" for i in range(max(0, shards - len(squeue)))]
    bin_dir = root / "bin"
    bin_dir.mkdir()
    for name, out in (("sacct", sacct), ("squeue", squeue)):
        (bin_dir / f"{name}.out").write_text("\n".join(out) + "\n")
        script = bin_dir / name
        # the argument's size is kept: the old code passed every task id to `sacct -j`
        script.write_text(f'#!/bin/sh\nprintf "%s" "$*" > "$0.args"\ncat "{bin_dir / name}.out"\n')
        script.chmod(0o755)
    counts["sacct_lines"], counts["squeue_lines"] = len(sacct), len(squeue)
    return run.path, bin_dir, counts


def time_status(code: Path, run_dir: Path, bin_dir: Path, out: Path) -> tuple[float, int]:
    """(seconds, peak RSS in KiB) of one `python -m batchinfer.cli status DIR` with code first on the path."""
    env = dict(os.environ, PYTHONPATH=str(code), PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    err = out.with_suffix(".err")
    with out.open("w") as f, err.open("w") as e:
        t0 = time.perf_counter()
        # cwd: `python -m` puts it first on sys.path, before PYTHONPATH: not a checkout's folder
        proc = subprocess.Popen(
            [sys.executable, "-m", "batchinfer.cli", "status", str(run_dir)],
            stdout=f,
            stderr=e,
            env=env,
            cwd=run_dir.parent,
        )
        _, status, usage = os.wait4(proc.pid, 0)  # wait4: this child's own peak RSS
        seconds = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"status failed under {code}:\n{err.read_text()}")
    return seconds, usage.ru_maxrss


def time_imports(code: Path, cwd: Path) -> float:
    """Seconds to start Python and import what `status` imports: the floor under its time."""
    env = dict(os.environ, PYTHONPATH=str(code))
    mods = "import batchinfer.cli, batchinfer.insight.status, batchinfer.launch.jobs, batchinfer.rundir.store"
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", mods], env=env, check=True, cwd=cwd)
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    """Build the run directory, time status under each code version, print and write the table."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", type=int, default=10_000)
    ap.add_argument("--arrays", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--old", type=Path, help="a checkout of the code to compare with (e.g. a git worktree)")
    ap.add_argument("--old-label", default="before")
    ap.add_argument("--out", type=Path, help="write the results as Markdown here")
    ap.add_argument(
        "--build-with", type=Path, default=ROOT, help="the checkout whose `prepare` builds the run directory"
    )
    ap.add_argument("--build", type=Path, help=argparse.SUPPRESS)  # internal: build under this folder, print JSON
    a = ap.parse_args()
    if a.build:
        run_dir, bin_dir, counts = build(a.build, a.shards, a.arrays)
        print(json.dumps({"run_dir": str(run_dir), "bin_dir": str(bin_dir), "counts": counts}))
        return
    a.load = os.getloadavg()
    versions = [("after", ROOT)] + ([(a.old_label, a.old.resolve())] if a.old else [])
    root = Path(tempfile.mkdtemp(prefix="status-bench-"))
    try:
        t0 = time.perf_counter()
        # built in a child: a forked child's peak RSS starts at its parent's, so this process stays small
        res = subprocess.run(
            [sys.executable, __file__, "--build", str(root), "--shards", str(a.shards), "--arrays", str(a.arrays)],
            capture_output=True,
            text=True,
            cwd=root,
            env=dict(os.environ, PYTHONPATH=str(a.build_with.resolve())),
        )
        if res.returncode != 0:
            raise SystemExit(f"building the run directory failed:\n{res.stderr}")
        built = json.loads(res.stdout.splitlines()[-1])
        run_dir, bin_dir, counts = Path(built["run_dir"]), Path(built["bin_dir"]), built["counts"]
        build_s = time.perf_counter() - t0
        results, texts = [], {}
        for label, code in versions:
            out = root / f"status-{label}.txt"
            time_status(code, run_dir, bin_dir, out)  # warm-up: files in the page cache for every version alike
            runs = [time_status(code, run_dir, bin_dir, out) for _ in range(a.repeats)]
            texts[label] = out.read_text()
            results.append(
                {
                    "code": label,
                    "shards": a.shards,
                    "seconds": round(statistics.median(s for s, _ in runs), 3),
                    "runs": [round(s, 3) for s, _ in runs],
                    "peak_rss_mb": round(max(r for _, r in runs) / 1024, 1),
                    "sacct_arg_bytes": (bin_dir / "sacct.args").stat().st_size,
                    "import_s": round(time_imports(code, root), 3),
                }
            )
        same = len(set(texts.values())) == 1
        print(f"{'code':<8} {'shards':>7} {'seconds':>8} {'peak RSS MB':>12} {'sacct -j bytes':>15} {'imports s':>10}")
        for r in results:
            print(
                f"{r['code']:<8} {r['shards']:>7} {r['seconds']:>8.3f} {r['peak_rss_mb']:>12.1f} "
                f"{r['sacct_arg_bytes']:>15} {r['import_s']:>10.3f}"
            )
        summary = texts["after"].splitlines()[-1]
        print(summary)
        if len(results) > 1:
            print(f"same status text from every version: {same}")
        print(json.dumps({"results": results, "counts": counts, "build_s": round(build_s, 1), "same_output": same}))
        if a.out:
            write_markdown(a, results, counts, summary, same)
    finally:
        shutil.rmtree(root, ignore_errors=True)


# Said under the table when --old is the code before status looked up Slurm per array and logs by name.
WHAT_DIFFERS = """The difference: before, `status` passed every task id to `sacct -j` (the argument's size above)
and found a failed shard's log with a glob of the log folder, so each of the {failed:,} failed shards
listed {log_files:,} files; after, sacct is asked about the array job ids and reads their task lines
back, and each failed task's stderr log is opened by the name submitit gave it, read from its end."""


def write_markdown(
    a: argparse.Namespace, results: list[dict[str, Any]], counts: dict[str, int], summary: str, same: bool
) -> None:
    """benchmarks/results/status.md: the figures, the command, the machine."""
    args = ["--shards", str(a.shards), "--arrays", str(a.arrays), "--repeats", str(a.repeats)]
    if a.old:
        args += ["--old", str(a.old), "--old-label", a.old_label]
    if a.build_with != ROOT:
        args += ["--build-with", str(a.build_with)]
    if a.out:
        args += ["--out", str(a.out)]
    cmd = shlex.join(["python", "benchmarks/status_bench.py", *args])
    rows = "\n".join(
        f"| {r['code']} | {r['shards']:,} | {r['seconds']:.2f} | {', '.join(f'{s:.2f}' for s in r['runs'])} "
        f"| {r['peak_rss_mb']:.0f} | {r['sacct_arg_bytes']:,} | {r['import_s']:.2f} |"
        for r in results
    )
    text = f"""# `batchinfer status` of {a.shards:,} shards

Target (issue 16): under 3 s on this machine. `python -m batchinfer.cli status DIR` in a
subprocess, after one warm-up run; median of {a.repeats}; peak RSS of that process.

| code | shards | median s | runs s | peak RSS MB | `sacct -j` argument, bytes | Python + imports s |
|---|---:|---:|---:|---:|---:|---:|
{rows}

The run directory: a real `prepare` with `sharding.num_shards={a.shards}`; {counts["done"]:,} shards
with a DONE.json, {counts["running"]:,} running and {counts["failed_after_commit"]:,} failed with a progress.json
({SERIES_POINTS} series points each, as a shard committed every 500 of 10K rows would have),
{counts["failed_before_commit"]:,} failed before their first commit, {counts["pending"]:,} pending;
jobs.jsonl with {a.arrays} arrays of {-(-a.shards // a.arrays):,} one-shard tasks; a log folder of
{counts["log_files"]:,} files (err, out and two pickles per task, named as submitit names them); fake
`sacct` and `squeue` printing {counts["sacct_lines"]:,} and {counts["squeue_lines"]:,} lines
(the files on a local disk, in the page cache: a shared filesystem makes every listing and stat dearer,
which is what the by-name log lookup saves most).
{"Both versions print the same status text." if same and len(results) > 1 else ""}

{WHAT_DIFFERS.format(failed=counts["failed_after_commit"] + counts["failed_before_commit"], **counts) if a.old else ""}

Status's summary line: `{summary}`

Command: `{cmd}`

CPU: {cpu_name()} ({os.cpu_count()} logical CPUs); Python {platform.python_version()}; {time.strftime("%Y-%m-%d")};
1-minute load average before and after the timed runs: {a.load[0]:.2f}, {os.getloadavg()[0]:.2f}
(other work on the machine slows every figure alike).
"""
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(text)
    print(f"written: {a.out}")


if __name__ == "__main__":
    main()
