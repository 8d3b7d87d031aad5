"""Preparing a run over a Parquet corpus read in place, against pyarrow reading its footers and its data.

A synthetic corpus (gen_corpus.py's rows, ~415 bytes a row as JSON) is written as Parquet files of
1M rows in row groups of 250,000 (snappy). Each in a fresh process: (a) `pq.read_metadata` of every
file (a footer-only pass: the floor), (b) a full pyarrow read (every file streamed batch by batch and
dropped), (c) `prepare` without an id column (fingerprint from footers, manifest, plan), (d) `prepare`
with input.id_column=id (the id column read for the duplicate check), (e) what a task does for one
shard: open DIR/input and `select(10,000 rows in the middle).to_list()`. Reported: in-process and
process time, CPU, peak RSS and anonymous RSS (prepare_bench.measure), and the bytes under DIR/input.
usage: python benchmarks/prepare_parquet_bench.py [--rows 10000000] [--dir /tmp/prepare-parquet-bench]
       [--repeats 3] [--keep]
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from gen_corpus import lines as corpus_lines  # noqa: E402
from prepare_bench import RSS, measure  # noqa: E402

FILE_ROWS = 1_000_000
GROUP_ROWS = 250_000

METADATA = f"""
import glob, json, sys, time
t0 = time.perf_counter()
import pyarrow.parquet as pq
t1 = time.perf_counter()
start_mb = {RSS}
rows = sum(pq.read_metadata(f).num_rows for f in sorted(glob.glob(sys.argv[1])))
print(json.dumps({{"rows": rows, "inner": time.perf_counter() - t1, "imports": t1 - t0, "start_mb": start_mb}}))
"""

READ = f"""
import glob, json, sys, time
t0 = time.perf_counter()
import pyarrow.parquet as pq
t1 = time.perf_counter()
start_mb = {RSS}
rows = 0
for f in sorted(glob.glob(sys.argv[1])):
    for batch in pq.ParquetFile(f).iter_batches():
        rows += batch.num_rows
print(json.dumps({{"rows": rows, "inner": time.perf_counter() - t1, "imports": t1 - t0, "start_mb": start_mb}}))
"""

PREPARE = f"""
import json, sys, time
from pathlib import Path
t0 = time.perf_counter()
from batchinfer.config.compose import compose
from batchinfer.rundir.prepare import prepare
import datasets  # imported by prepare when it checks the types: an import, timed apart as in prepare_bench
t1 = time.perf_counter()
start_mb = {RSS}
pattern, out, model, ids = sys.argv[1:5]
extra = ["input.id_column=id"] if ids == "1" else []
run = prepare(compose([f"input.path={{pattern}}", f"model.path={{model}}", f"output.dir={{out}}", *extra]))
inner = time.perf_counter() - t1
rows = json.loads((run.path / "plan.json").read_text())["rows"]
written = sum(f.stat().st_size for f in run.input_dir.rglob("*") if f.is_file())
print(json.dumps({{"rows": rows, "inner": inner, "imports": t1 - t0, "start_mb": start_mb, "input_bytes": written}}))
"""

SHARD = f"""
import json, sys, time
from pathlib import Path
t0 = time.perf_counter()
from batchinfer.inputs.convert import open_input
t1 = time.perf_counter()
start_mb = {RSS}
ds = open_input(Path(sys.argv[1]) / "input")
mid = len(ds) // 2 + 123_456
got = ds.select(list(range(mid, mid + 10_000))).to_list()
assert got[0]["id"] == f"doc-{{mid:09d}}" and got[-1]["id"] == f"doc-{{mid + 9999:09d}}"
print(json.dumps({{"rows": len(got), "inner": time.perf_counter() - t1, "imports": t1 - t0, "start_mb": start_mb}}))
"""


def write_parquet(folder: Path, rows: int) -> int:
    """The corpus as Parquet files of FILE_ROWS rows; their total size."""
    import pyarrow.json as paj
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    for n, start in enumerate(range(0, rows, FILE_ROWS)):
        text = "".join(corpus_lines(min(FILE_ROWS, rows - start), start=start)).encode()
        table = paj.read_json(io.BytesIO(text))
        pq.write_table(table, folder / f"part-{n:03d}.parquet", row_group_size=GROUP_ROWS)
    return sum(f.stat().st_size for f in folder.glob("*.parquet"))


def bench(rows: int, root: Path, repeats: int) -> list[dict[str, Any]]:
    """Each system `repeats` times, alternating; the median run of each."""
    folder = root / f"parquet-{rows}"
    if not folder.exists():
        t = time.perf_counter()
        # In a child: the generator's memory would count in the peak RSS of every process forked after it.
        code = f"import sys; sys.path.insert(0, {str(HERE)!r}); from prepare_parquet_bench import write_parquet; "
        code += f"from pathlib import Path; write_parquet(Path({str(folder)!r}), {rows})"
        subprocess.run([sys.executable, "-c", code], check=True)
        size = sum(f.stat().st_size for f in folder.glob("*.parquet"))
        print(f"generated {folder}: {size / 1e6:.0f} MB in {time.perf_counter() - t:.0f} s", flush=True)
    size = sum(f.stat().st_size for f in folder.glob("*.parquet"))
    pattern = str(folder / "*.parquet")
    model = root / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    systems = ["read_metadata", "pyarrow full read", "prepare", "prepare + id check", "one shard (10,000 rows)"]
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    for _ in range(repeats):
        runs["read_metadata"].append(measure(METADATA, [pattern], str(REPO)))
        runs["pyarrow full read"].append(measure(READ, [pattern], str(REPO)))
        for name, ids in (("prepare", "0"), ("prepare + id check", "1")):
            out = root / f"run-{ids}"
            shutil.rmtree(out, ignore_errors=True)
            runs[name].append(measure(PREPARE, [pattern, str(out), str(model), ids], str(REPO)))
        runs["one shard (10,000 rows)"].append(measure(SHARD, [str(root / "run-1")], str(REPO)))
        for name, rs in runs.items():
            print(f"  {rows} rows {name}: {json.dumps(rs[-1])}", flush=True)
    out = []
    for name, rs in runs.items():
        med = sorted(rs, key=lambda r: r["inner"])[len(rs) // 2]
        out.append(dict(med, system=name, corpus_rows=rows, bytes=size, inner_all=[r["inner"] for r in rs]))
    return out


def table(results: list[dict[str, Any]]) -> str:
    """Markdown, each line against read_metadata and the full read of the same corpus."""
    lines = [
        "| rows | Parquet MB | system | in-process s (median) | all runs s | process s | process CPU s "
        "| x read_metadata | x full read | peak RSS MB | peak anon MB | bytes under DIR/input | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    meta = {r["corpus_rows"]: r for r in results if r["system"] == "read_metadata"}
    full = {r["corpus_rows"]: r for r in results if r["system"] == "pyarrow full read"}
    for r in results:
        m, f = meta[r["corpus_rows"]], full[r["corpus_rows"]]
        shown = ", ".join(f"{x:.2f}" for x in r["inner_all"])
        lines.append(
            f"| {r['corpus_rows']:,} | {r['bytes'] / 1e6:.0f} | {r['system']} | {r['inner']:.2f} | {shown} "
            f"| {r['wall']:.2f} | {r['cpu']:.2f} | {r['inner'] / m['inner']:.1f} | {r['inner'] / f['inner']:.3f} "
            f"| {r['peak_mb']:.0f} | {r['anon_mb']:.0f} | {r.get('input_bytes', '')} | {r['load']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/prepare-parquet-bench"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--keep", action="store_true", help="keep the corpus")
    ap.add_argument("--json", type=Path, help="write the results here too")
    a = ap.parse_args()
    a.dir.mkdir(parents=True, exist_ok=True)
    try:
        results = bench(a.rows, a.dir, a.repeats)
    finally:
        if not a.keep:
            shutil.rmtree(a.dir, ignore_errors=True)
    print(table(results))
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
