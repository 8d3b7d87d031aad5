"""A task streaming its shard (issue 16): how soon the first request reaches the engine, and how much
the worker's own process grows, on a 1M-row shard against a 10K-row shard.

Each corpus is one shard (`sharding.num_shards=1`) of short rows on the tests' tiny model with
`sampling.max_tokens=1` and `model.max_num_seqs=256` (a GPU-like queue). A run is stopped with
SIGTERM once progress.json shows --stop rows committed (50K, or half a smaller shard), then
resumed and stopped again after as many more rows. Measured per run, from outside the worker:
- ready: when the worker logs "engine ready"; first step: the first line the worker writes to
  BATCHINFER_TRACE (the first engine step that finished, so just after the first request);
  `first_request_seconds` from progress.json where the code records it;
- the worker's own VmRSS (its engine-core children are other processes), sampled every 0.1 s:
  at ready, and the peak after ready; RssAnon likewise (the mapped input is file pages).
The same runs with another checkout's code (--old-src, e.g. a `git worktree` of the commit before).
usage: python benchmarks/stream_bench.py [--rows 1000000 10000] [--stop 50000] [--old-src /tmp/stream-old]
       [--dir /tmp/stream-bench] [--label new]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
WORDS = "alpha beta gamma delta river stone cloud paper green quiet swift bright table window garden".split()


def corpus(path: Path, rows: int) -> Path:
    """Short rows {id, text}: 3 to 10 words and a number (about 1% repeat an earlier row's text)."""
    if path.is_file():
        return path
    rng = random.Random(0)
    with path.open("w") as f:
        for i in range(rows):
            if i > 100 and rng.random() < 0.01:
                text = f"{rng.choice(WORDS)} {rng.randrange(i)}"
            else:
                text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10))) + f" {rng.randrange(10**6)}"
            f.write(json.dumps({"id": f"r{i:07d}", "text": text}) + "\n")
    return path


def status(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM and RssAnon of one process, in kB."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon"):
                out[key] = int(value.split()[0])
    except OSError:
        pass
    return out


def run_once(src: Path, rows: Path, out: Path, model: Path, stop_at: int, log: Path) -> dict[str, Any]:
    """One `batchinfer run` of the shard, SIGTERM once stop_at rows are committed; the figures."""
    trace = out.parent / f"{out.name}.trace"
    trace.unlink(missing_ok=True)
    progress = out / "shards" / "00000" / "progress.json"
    before = json.loads(progress.read_text())["rows_done"] if progress.is_file() else 0
    env = dict(os.environ, BATCHINFER_TRACE=str(trace), VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=str(src))
    cmd = [sys.executable, "-m", "batchinfer.cli", "run", f"input.path={rows}", "input.id_column=id"]
    cmd += [f"output.dir={out}", "sampling.max_tokens=1", "sharding.num_shards=1", f"model.path={model}"]
    cmd += ["model.enforce_eager=true", "model.max_model_len=128", "model.max_num_seqs=256"]
    t_start = time.time()
    proc = subprocess.Popen(cmd, cwd=src, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ready: dict[str, float] = {}

    def read_stderr() -> None:
        with log.open("w") as f:
            for line in proc.stderr:  # type: ignore[union-attr]
                f.write(line)
                if "engine ready in" in line and "t" not in ready:
                    ready["t"] = time.time()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    rss_ready: Optional[dict[str, int]] = None
    peak = {"VmRSS": 0, "RssAnon": 0}
    last: dict[str, int] = {}
    stopped_at = None
    while proc.poll() is None:
        s = status(proc.pid)
        if s:
            last = s
        if "t" in ready and s:
            if rss_ready is None:
                rss_ready = s
            for k in peak:
                peak[k] = max(peak[k], s.get(k, 0))
        if stopped_at is None and progress.is_file():
            try:
                done = json.loads(progress.read_text()).get("rows_done", 0)
            except (OSError, json.JSONDecodeError):
                done = 0
            if done >= stop_at:
                stopped_at = time.time()
                proc.send_signal(signal.SIGTERM)
        time.sleep(0.1)
    reader.join(timeout=10)
    t_end = time.time()
    record = json.loads(progress.read_text()) if progress.is_file() else {}
    first_step = float(trace.read_text().split()[0]) if trace.is_file() and trace.stat().st_size else None
    mb = 1 / 1024
    return {
        "returncode": proc.returncode,
        "wall_s": round(t_end - t_start, 1),
        "ready_s": round(ready["t"] - t_start, 1) if "t" in ready else None,
        "first_step_after_ready_s": round(first_step - ready["t"], 2) if first_step and "t" in ready else None,
        "first_request_seconds": record.get("first_request_seconds"),
        "rows_done": record.get("rows_done"),
        "rows_per_s_after_first_step": (
            round((record.get("rows_done", 0) - before) / (stopped_at - first_step), 1)
            if stopped_at and first_step
            else None
        ),
        "rss_ready_mb": round(rss_ready["VmRSS"] * mb) if rss_ready else None,
        "rss_peak_after_ready_mb": round(peak["VmRSS"] * mb),
        "rss_growth_mb": round((peak["VmRSS"] - rss_ready["VmRSS"]) * mb) if rss_ready else None,
        "anon_ready_mb": round(rss_ready.get("RssAnon", 0) * mb) if rss_ready else None,
        "anon_growth_mb": round((peak["RssAnon"] - rss_ready.get("RssAnon", 0)) * mb) if rss_ready else None,
        "hwm_mb": round(last.get("VmHWM", 0) * mb),
        "seconds": record.get("seconds"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 10_000])
    ap.add_argument("--stop", type=int, default=50_000, help="rows committed before each stop")
    ap.add_argument("--old-src", type=Path, help="a checkout of the code before, measured the same way")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/stream-bench"))
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT / "tests" / "support"))
    import tiny_model

    model = tiny_model.build(args.dir / "tiny-llama")
    srcs = [("new", ROOT)] + ([("old", args.old_src.resolve())] if args.old_src else [])
    results = []
    for n in args.rows:
        rows = corpus(args.dir / f"rows-{n}.jsonl", n)
        stop = min(args.stop, n // 2)
        for label, src in srcs:
            out = args.dir / f"run-{label}-{n}"
            subprocess.run(["rm", "-rf", str(out)], check=True)
            for phase, stop_at in (("fresh", stop), ("resumed", 2 * stop)):
                r = run_once(src, rows, out, model, stop_at, args.dir / f"{label}-{n}-{phase}.log")
                r.update(code=label, rows=n, phase=phase)
                results.append(r)
                print(json.dumps(r), flush=True)
    (args.dir / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
