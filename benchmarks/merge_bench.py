"""Merge rate and peak memory vs pyarrow's own read + write of the same rows (target: at least half).

Builds a finished run directory of committed parts (no engine: rows as a worker commits them, in a
shuffled commit order, shards of --shard-rows rows in parts of --part-rows), then times, each in a
child process whose peak RSS is read from wait4:
  - `merge` of the shards still in parts (DONE.json naming no compacted file: an earlier version's run),
  - pyarrow reading those parts and writing one Parquet file (the baseline),
  - compaction of every shard (ShardFolder.finish, as the worker does when a shard finishes),
  - `merge` of the compacted shards, and the baseline over the compacted files.
For JSONL output the baseline reads the JSON lines with pyarrow.json (the run's schema) and writes
Parquet: pyarrow has no JSON writer. Medians of --repeats, alternating ours and the baseline.

usage: python benchmarks/merge_bench.py [--rows 1000000] [--formats parquet jsonl] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from _common import prepared_run

TEXTS = [
    "positive",
    "a label and a short explanation of it, as a model writes " * 2,
    "The abstract describes a method for measuring protein folding rates in vitro.",
    "négatif — the review says the battery lasts a day, not the week it promised",
]


def build(root: Path, rows: int, shard_rows: int, part_rows: int, fmt: str) -> Path:
    """A finished run directory (DONE.json naming no compacted file) of `rows` rows."""
    from batchinfer.rundir.durable import write_json

    from batchinfer.rundir.store import RunDir

    run, ids = prepared_run(root, rows, fmt, f"sharding.rows_per_shard={shard_rows}")
    run = RunDir(run.path)
    rng = np.random.default_rng(0)
    texts = pa.array(TEXTS)
    for shard in run.shards():
        run.shard_dir(shard.index).mkdir(parents=True, exist_ok=True)
        order = rng.permutation(np.arange(shard.start, shard.stop))  # commit order is not row order
        for start in range(0, len(order), part_rows):
            r = order[start : start + part_rows]
            error = pa.array(
                [{"kind": "prompt", "message": "too long"} if x % 97 == 0 else None for x in r.tolist()],
                run.schema.field("error").type,
            )
            table = pa.table(
                {
                    "row": pa.array(r, pa.int64()),
                    "id": ids.take(pa.array(r)),
                    "text": texts.take(pa.array(r % len(TEXTS))),
                    "finish_reason": pa.array(np.where(r % 11 == 0, "length", "stop")),
                    "prompt_tokens": pa.array(40 + r % 50, pa.int32()),
                    "output_tokens": pa.array(r % 30, pa.int32()),
                    "error": error,
                },
                schema=run.schema,
            )
            run.shard_folder(shard.index).write_part(table)
        write_json(run.shard_folder(shard.index).done_path, {"rows_done": shard.rows, "seconds": {"generate": 1.0}})
    return run.path


def baseline(run_dir: Path, out: Path) -> None:
    """pyarrow's own speed: read every file of the shards (parts or compacted) and write one Parquet file."""
    import pyarrow.json as pj

    from batchinfer.rundir.store import RunDir

    run = RunDir(run_dir)
    writer = pq.ParquetWriter(out, run.schema, compression="zstd")
    for shard in run.shards():
        for p in run.shard_folder(shard.index).committed_files():
            if p.suffix == ".jsonl":
                opts = pj.ParseOptions(explicit_schema=run.schema)
                t = pj.read_json(p, read_options=pj.ReadOptions(block_size=16 << 20), parse_options=opts)
                t = t.cast(run.schema)
            else:
                t = pq.read_table(p)
            writer.write_table(t)
    writer.close()


def child(what: str, run_dir: str, out: str) -> None:
    """Run one measured step in this (child) process; print its seconds."""
    from batchinfer.rundir.merge import merge
    from batchinfer.rundir.store import RunDir

    t0 = time.perf_counter()
    if what == "merge":
        merge(RunDir(run_dir))
    elif what == "baseline":
        baseline(Path(run_dir), Path(out))
    else:  # compact every shard, as each worker does when its shard finishes
        run = RunDir(run_dir)
        for shard in run.shards():
            folder = run.shard_folder(shard.index)
            folder.finish(json.loads(folder.done_path.read_text()))
    seconds = time.perf_counter() - t0
    print(json.dumps({"seconds": seconds, "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))


def measure(what: str, run_dir: Path, out: Path) -> dict[str, float]:
    """Seconds and peak RSS (MB) of one step in a child process. The child is forked by a shell,
    not by this process: Linux counts the RSS a process had before exec in its ru_maxrss, and this
    one holds the built data."""
    cmd = ["sh", "-c", '"$@"; exit $?', "sh", sys.executable, __file__, "--child", what, str(run_dir), str(out)]
    res = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if res.returncode != 0:
        raise SystemExit(f"{what} failed ({res.returncode}): {res.stdout}")
    got = json.loads(res.stdout.splitlines()[-1])
    return {"s": got["seconds"], "rss_mb": got["maxrss_kb"] / 1024}


def med(results: list[dict[str, float]]) -> dict[str, float]:
    return {k: round(statistics.median(r[k] for r in results), 2) for k in results[0]}


def compare(run_dir: Path, root: Path, repeats: int) -> dict[str, Any]:
    ours, theirs = [], []
    for _ in range(repeats):
        ours.append(measure("merge", run_dir, root / "unused"))
        theirs.append(measure("baseline", run_dir, root / "baseline.parquet"))
        (root / "baseline.parquet").unlink()
    m, b = med(ours), med(theirs)
    return {"merge": m, "pyarrow": b, "ratio": round(b["s"] / m["s"], 2)}


def main() -> None:
    """Build, measure, print one JSON line per format and a markdown table."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--shard-rows", type=int, default=10_000)
    ap.add_argument("--part-rows", type=int, default=1000)
    ap.add_argument("--formats", nargs="+", default=["parquet", "jsonl"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", nargs=3)
    a = ap.parse_args()
    if a.child:
        return child(*a.child)
    lines = []
    for fmt in a.formats:
        root = Path(tempfile.mkdtemp(prefix="merge-bench-", dir=os.environ.get("BENCH_DIR")))
        try:
            load = os.getloadavg()[0]
            t0 = time.perf_counter()
            run_dir = build(root, a.rows, a.shard_rows, a.part_rows, fmt)
            built = time.perf_counter() - t0
            n_parts = len(list(run_dir.glob("shards/*/part-*")))
            size = sum(p.stat().st_size for p in run_dir.glob("shards/*/part-*"))
            parts = compare(run_dir, root, a.repeats)
            compaction = measure("compact", run_dir, root / "unused")
            compacted = compare(run_dir, root, a.repeats)
            result = {
                "format": fmt,
                "rows": a.rows,
                "shards": len(list(run_dir.glob("shards/*/DONE.json"))),
                "parts": n_parts,
                "parts_mb": round(size / 1e6),
                "output_mb": round(sum(p.stat().st_size for p in run_dir.glob("output*")) / 1e6),
                "build_s": round(built, 1),
                "in_parts": parts,
                "compaction": {k: round(v, 2) for k, v in compaction.items()},
                "compacted": compacted,
                "load_before": round(load, 2),
                "load_after": round(os.getloadavg()[0], 2),
            }
            print(json.dumps(result), flush=True)
            lines.append(result)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    print(
        "| output | rows | shards | shards as | merge s | pyarrow s | ratio | merge peak RSS MB | pyarrow peak RSS MB |"
    )
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|")
    for r in lines:
        for key, label in (("in_parts", f"{r['parts']:,} parts"), ("compacted", "compacted")):
            c = r[key]
            print(
                f"| {r['format']} | {r['rows']:,} | {r['shards']:,} | {label} | {c['merge']['s']} | "
                f"{c['pyarrow']['s']} | {c['ratio']} | {c['merge']['rss_mb']:.0f} | {c['pyarrow']['rss_mb']:.0f} |"
            )


if __name__ == "__main__":
    main()
