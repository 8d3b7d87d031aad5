"""Work lost to a SIGKILL at a random moment, against the commit interval (target: <= one).

Starts `batchinfer run` on the chat profile, kills the whole process group at a random moment
after its first commit, and compares the rows the worker had finished (BATCHINFER_TRACE) with
the rows committed in parts: the difference is finished work a resume redoes. Rows still in
flight at the kill are not lost work (no commit interval could have saved them).
usage: python benchmarks/redo_bench.py [--kills 5] [--commit-every-rows 16]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from profiles import PROFILES, make_rows, write_rows  # noqa: E402


def parts(out: Path) -> list[Path]:
    """Committed parts."""
    return sorted(out.glob("shards/*/part-*"), key=lambda p: p.stat().st_mtime)


def one_kill(rows: Path, out: Path, every: int, rng: random.Random) -> dict[str, float]:
    """Kill a run at a random moment after its first commit; return the lost seconds and interval."""
    shutil.rmtree(out, ignore_errors=True)
    p = PROFILES["chat"]
    cmd = [sys.executable, "-m", "batchinfer.cli", "run", f"input.path={rows}", "input.id_column=id"]
    cmd += [f"output.dir={out}", f"sampling.max_tokens={p.max_tokens}", f"output.commit_every_rows={every}"]
    trace = out.with_name("trace.txt")
    trace.unlink(missing_ok=True)
    env = dict(os.environ, BATCHINFER_TRACE=str(trace))  # the worker appends "<time> <rows finished>"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env)
    while not parts(out):
        if proc.poll() is not None:
            raise SystemExit("the run ended before its first commit")
        time.sleep(0.02)
    time.sleep(rng.uniform(0.5, 4.0))
    t_kill = time.time()
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    committed = parts(out)
    times = [c.stat().st_mtime for c in committed]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    finished = int(trace.read_text().split()[-1])
    rows_committed = sum(pq.read_metadata(c).num_rows for c in committed)
    return {
        "finished_rows": finished,
        "committed_rows": rows_committed,
        "lost_rows": finished - rows_committed,
        "commit_every_rows": every,
        "since_last_commit_s": t_kill - times[-1],
        "median_commit_gap_s": statistics.median(gaps) if gaps else float("nan"),
        "parts": len(committed),
    }


def main() -> None:
    """Several kills; print each and the worst lost/interval ratio."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--commit-every-rows", type=int, default=16)
    a = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    root = Path(tempfile.mkdtemp(prefix="redo-bench-"))
    rng = random.Random(0)
    try:
        rows = root / "chat.jsonl"
        write_rows(make_rows(PROFILES["chat"], 0.0), rows)
        results = [one_kill(rows, root / "run", a.commit_every_rows, rng) for _ in range(a.kills)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for r in results:
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}))
    worst = max(r["lost_rows"] for r in results)
    print(json.dumps({"kills": len(results), "worst_lost_rows": worst, "commit_every_rows": a.commit_every_rows}))


if __name__ == "__main__":
    main()
