"""Merge rate vs pyarrow's own read + write of the same rows (target: at least half).

Builds a run directory of committed parts (no engine: rows as a worker commits them), then
times `batchinfer merge` against reading every part with pyarrow and writing one Parquet file.
usage: python benchmarks/merge_bench.py [--rows 2000000] [--shards 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq


def build(root: Path, rows: int, shards: int, part_rows: int) -> Path:
    """A finished run directory with `rows` rows in parts of `part_rows`."""
    from batchinfer.config.compose import compose
    from batchinfer.rundir.prepare import prepare
    from batchinfer.rundir.schema import rows_to_table
    from batchinfer.rundir.store import RunDir, write_json

    corpus = root / "corpus.jsonl"
    with open(corpus, "w") as f:
        for i in range(rows):
            f.write(json.dumps({"id": f"doc-{i:08d}", "text": f"row {i} of the benchmark corpus"}) + "\n")
    model = root / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    run = prepare(
        compose(
            [
                f"input.path={corpus}",
                "input.id_column=id",
                f"model.path={model}",
                f"sharding.num_shards={shards}",
                f"output.dir={root / 'run'}",
            ]
        )
    )
    run = RunDir(run.path)
    text = "a label and a short explanation of it, as a model writes " * 2
    for shard in run.shards():
        run.shard_dir(shard.index).mkdir(parents=True, exist_ok=True)
        for start in range(shard.start, shard.stop, part_rows):
            stop = min(start + part_rows, shard.stop)
            batch = [
                {
                    "row": r,
                    "id": f"doc-{r:08d}",
                    "text": text,
                    "finish_reason": "stop",
                    "prompt_tokens": 40,
                    "output_tokens": 24,
                    "error": None,
                }
                for r in range(start, stop)
            ]
            run.write_part(shard.index, rows_to_table(batch, run.schema))
        write_json(run.done_path(shard.index), {"rows_done": shard.rows, "seconds": {}})
    return run.path


def pyarrow_baseline(run_dir: Path, out: Path) -> float:
    """Read every part and write them to one Parquet file: pyarrow's own speed."""
    t0 = time.perf_counter()
    parts = sorted(run_dir.glob("shards/*/part-*.parquet"))
    writer = None
    for p in parts:
        t = pq.read_table(p)
        writer = writer or pq.ParquetWriter(out, t.schema, compression="zstd")
        writer.write_table(t)
    assert writer is not None
    writer.close()
    return time.perf_counter() - t0


def main() -> None:
    """Time both, alternating, and print medians and the ratio."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--part-rows", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    from batchinfer.rundir.merge import merge
    from batchinfer.rundir.store import RunDir

    root = Path(tempfile.mkdtemp(prefix="merge-bench-"))
    try:
        run_dir = build(root, a.rows, a.shards, a.part_rows)
        ours, theirs = [], []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            merge(RunDir(run_dir))
            ours.append(time.perf_counter() - t0)
            theirs.append(pyarrow_baseline(run_dir, root / "baseline.parquet"))
        m_ours, m_theirs = statistics.median(ours), statistics.median(theirs)
        result = {
            "rows": a.rows,
            "parts": len(list(run_dir.glob("shards/*/part-*"))),
            "merge_s": round(m_ours, 3),
            "pyarrow_s": round(m_theirs, 3),
            "merge_rows_s": round(a.rows / m_ours),
            "pyarrow_rows_s": round(a.rows / m_theirs),
            "ratio": round(m_theirs / m_ours, 3),
        }
        print(json.dumps(result))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
