"""Peak RSS of sealing one big shard (ShardFolder.finish: compaction of its parts into rows.*).

Builds a run directory of one shard of --rows rows committed as a worker commits them (parts of
--part-rows rows, each sorted by row at commit, the rows of a part spread over the whole shard as
work order spreads them), then seals it in a child process and prints that child's peak RSS (from
wait4, the child forked by a shell so that this process's memory is not counted) and seconds, with
the size of the parts. Run it against another checkout with --code DIR (that DIR first on the
child's PYTHONPATH): the same run directory, the other version's compaction.

usage: python benchmarks/compaction_rss.py [--rows 200000] [--part-rows 500] [--formats parquet jsonl]
                                          [--code /path/to/other/checkout]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
from _common import prepared_run

# Output texts of a few hundred characters, as a model's answers.
WORDS = "the of a model answer label because review battery protein method measured week day short".split()


def build(root: Path, rows: int, part_rows: int, fmt: str) -> Path:
    """A run directory whose one shard has every row committed, no DONE.json."""

    run, ids = prepared_run(root, rows, fmt, "sharding.num_shards=1")
    rng = np.random.default_rng(0)
    texts = pa.array([" ".join(rng.choice(WORDS, size=60 + k % 40)) for k in range(997)])
    shard = run.shards()[0]
    run.shard_dir(0).mkdir(parents=True, exist_ok=True)
    order = rng.permutation(np.arange(shard.start, shard.stop))  # work order: by prompt, not by row
    for start in range(0, len(order), part_rows):
        r = np.sort(order[start : start + part_rows])  # a part is sorted by row at commit
        table = pa.table(
            {
                "row": pa.array(r, pa.int64()),
                "id": ids.take(pa.array(r)),
                "text": texts.take(pa.array(r % len(texts))),
                "finish_reason": pa.array(np.where(r % 11 == 0, "length", "stop")),
                "prompt_tokens": pa.array(40 + r % 50, pa.int32()),
                "output_tokens": pa.array(60 + r % 40, pa.int32()),
                "error": pa.nulls(len(r), run.schema.field("error").type),
            },
            schema=run.schema,
        )
        run.shard_folder(0).write_part(table)
    return run.path


def child(run_dir: str) -> None:
    """Seal the shard in this (child) process; print seconds and peak RSS."""
    import batchinfer
    from batchinfer.rundir.store import RunDir

    run = RunDir(run_dir)
    # --code may name a checkout from before ShardFolder (its RunDir.finish_shard took the index)
    seal = run.shard_folder(0).finish if hasattr(run, "shard_folder") else lambda d: run.finish_shard(0, d)
    t0 = time.perf_counter()
    seal({"rows_done": run.shards()[0].rows})
    seconds = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"seconds": seconds, "maxrss_kb": rss, "code": str(Path(batchinfer.__file__).parent.parent)}))


def measure(run_dir: Path, code: str | None) -> dict[str, float]:
    env = dict(os.environ)
    if code:
        env["PYTHONPATH"] = code + os.pathsep + env.get("PYTHONPATH", "")
    cmd = ["sh", "-c", '"$@"; exit $?', "sh", sys.executable, __file__, "--child", str(run_dir)]
    res = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=code or None)
    if res.returncode != 0:
        raise SystemExit(f"sealing failed ({res.returncode}): {res.stdout}")
    got = json.loads(res.stdout.splitlines()[-1])
    return {"s": round(got["seconds"], 2), "rss_mb": round(got["maxrss_kb"] / 1024, 1), "code": got["code"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--part-rows", type=int, default=500)
    ap.add_argument("--formats", nargs="+", default=["parquet", "jsonl"])
    ap.add_argument("--code", help="another checkout whose compaction to measure on the same run directory")
    ap.add_argument("--child")
    a = ap.parse_args()
    if a.child:
        return child(a.child)
    for fmt in a.formats:
        root = Path(tempfile.mkdtemp(prefix="compaction-rss-", dir=os.environ.get("BENCH_DIR")))
        try:
            run_dir = build(root, a.rows, a.part_rows, fmt)
            parts = list(run_dir.glob("shards/00000/part-*"))
            size = sum(p.stat().st_size for p in parts)
            backup = root / "parts"
            shutil.copytree(run_dir / "shards", backup)
            result: dict[str, object] = {"format": fmt, "rows": a.rows, "parts": len(parts), "parts_mb": size / 1e6}
            for label, code in (("this", None), ("other", a.code)) if a.code else (("this", None),):
                shutil.rmtree(run_dir / "shards")
                shutil.copytree(backup, run_dir / "shards")
                result[label] = measure(run_dir, code)
            rows_file = next((run_dir / "shards/00000").glob("rows.*"))
            result["compacted_mb"] = round(rows_file.stat().st_size / 1e6, 1)
            result["parts_mb"] = round(size / 1e6, 1)
            print(json.dumps(result), flush=True)
        finally:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
