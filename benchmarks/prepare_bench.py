"""Preparing a run on a login node: batchinfer's `prepare` against a streaming pyarrow read of the same JSONL.

For each size, a synthetic corpus (gen_corpus.py, ~415 bytes a row) is read by (a) pyarrow's streaming
JSON reader, batches iterated and dropped, (a') the same, each batch written to an Arrow IPC file (what
any conversion at least does), and (b) `batchinfer.rundir.prepare.prepare` (input
fingerprint, conversion into DIR/input, id check, plan), each in a fresh process. Reported: the
process's wall time, its in-process time (imports apart) and CPU time (user + system), peak RSS (the kernel's maximum for the
process, as `/usr/bin/time -v` shows it) and peak anonymous RSS (polled: memory that is not a page of
a mapped file), and where batchinfer's time goes. Targets (issue 16): batchinfer within 2x pyarrow's
time, peak RSS under 2 GB and flat from 1M to 10M rows. Issue 44: with --short (rows of ~58 bytes, an id
and a few words, where pyarrow's parse is cheapest beside everything batchinfer does per byte and per
row), batchinfer within 2x pyarrow's read; pyarrow's `read_json` of the whole file is timed too.
usage: python benchmarks/prepare_bench.py [--rows 1000000 10000000] [--short] [--old-src /tmp/prep-old
       --old-rows 1000000] [--dir /tmp/prepare-bench] [--repeats 1] [--keep] [--plot out.png]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from _common import machine  # noqa: E402
from gen_corpus import write as write_corpus  # noqa: E402

RSS = "int(next(ln for ln in open('/proc/self/status') if ln.startswith('VmRSS')).split()[1]) / 1024"
PYARROW = f"""
import json, sys, time
t0 = time.perf_counter()
import pyarrow.json as paj
t1 = time.perf_counter()
start_mb = {RSS}
c1 = time.process_time()
rows = 0
for batch in paj.open_json(sys.argv[1]):
    rows += batch.num_rows
print(json.dumps({{"rows": rows, "inner": time.perf_counter() - t1, "inner_cpu": time.process_time() - c1, "imports": t1 - t0, "start_mb": start_mb}}))
"""

PYARROW_READ_JSON = f"""
import json, sys, time
t0 = time.perf_counter()
import pyarrow.json as paj
t1 = time.perf_counter()
start_mb = {RSS}
c1 = time.process_time()
rows = paj.read_json(sys.argv[1]).num_rows
print(json.dumps({{"rows": rows, "inner": time.perf_counter() - t1, "inner_cpu": time.process_time() - c1, "imports": t1 - t0, "start_mb": start_mb}}))
"""

# The floor of any conversion: the same read, each batch written to an Arrow IPC file beside it.
PYARROW_WRITE = f"""
import json, os, sys, time
t0 = time.perf_counter()
import pyarrow as pa, pyarrow.json as paj
t1 = time.perf_counter()
start_mb = {RSS}
c1 = time.process_time()
rows = 0
reader = paj.open_json(sys.argv[1])
with pa.OSFile(sys.argv[2], "wb") as sink, pa.ipc.new_stream(sink, reader.schema) as writer:
    for batch in reader:
        writer.write_batch(batch)
        rows += batch.num_rows
inner, inner_cpu = time.perf_counter() - t1, time.process_time() - c1
os.unlink(sys.argv[2])
print(json.dumps({{"rows": rows, "inner": inner, "inner_cpu": inner_cpu, "imports": t1 - t0, "start_mb": start_mb}}))
"""

# Times the phases of prepare by wrapping the functions that exist in the code under test (old or new);
# the phases nest: convert_input holds the others but file_fingerprint, _jsonl_to_arrow holds count_lines.
BATCHINFER = f"""
import json, sys, time
t0 = time.perf_counter()
import importlib
def inputs_module(name):
    try:  # inputs/read.py before issue 28; convert, datasets_reader, jsonl_stream after it
        return importlib.import_module("batchinfer.inputs." + name)
    except ImportError:
        return None
read, convert, datasets_reader, jsonl_stream = map(inputs_module, ["read", "convert", "datasets_reader", "jsonl_stream"])
import batchinfer.rundir.prepare as prep
from batchinfer.config.compose import compose
import datasets
phases = {{}}
def timed(owner, name, label):
    fn = getattr(owner, name, None)
    if fn is None:
        return
    def wrapper(*a, **k):
        s = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            phases[label] = phases.get(label, 0.0) + time.perf_counter() - s
    setattr(owner, name, wrapper)
for owner, name in [(prep, "file_fingerprint"), (prep, "convert_input"), (read, "scan_jsonl"),
                    (read, "_jsonl_to_arrow"), (read, "count_lines"), (read, "check_ids"),
                    (datasets_reader, "scan_jsonl"), (convert, "jsonl_to_arrow"), (jsonl_stream, "count_lines"),
                    (convert, "check_ids"), (datasets.Dataset, "from_json"), (datasets.Dataset, "save_to_disk")]:
    timed(owner, name, name)
corpus, out, model = sys.argv[1:4]
t1 = time.perf_counter()
start_mb = {RSS}
c1 = time.process_time()
cfg = compose([f"input.path={{corpus}}", "input.id_column=id", f"model.path={{model}}", f"output.dir={{out}}"])
tp = time.perf_counter()
run = prep.prepare(cfg)
t2 = time.perf_counter()
rows = json.loads((run.path / "plan.json").read_text())["rows"]
result = {{"rows": rows, "inner": t2 - t1, "inner_cpu": time.process_time() - c1, "prepare_s": t2 - tp,
          "compose_s": tp - t1, "imports": t1 - t0, "start_mb": start_mb, "phases": phases}}
print(json.dumps(dict(result, code=prep.__file__)))
"""


def _status(pid: int) -> dict[str, int]:
    """RssAnon and RssFile of a process, in kB (empty once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return {k: int(v.split()[0]) for k, v in (ln.split(":", 1) for ln in f) if k in ("RssAnon", "RssFile")}
    except (OSError, ValueError):
        return {}


def measure(code: str, args: list[str], pythonpath: str) -> dict[str, Any]:
    """Run `python -c code args` in a fresh process: its JSON line, wall time, peak RSS (wait4's, the
    kernel's own maximum) and peak RssAnon / RssFile (polled every 20 ms)."""
    env = dict(os.environ, PYTHONPATH=pythonpath, HF_DATASETS_OFFLINE="1")
    load = os.getloadavg()[0]  # other work on the machine slows both sides: kept with each figure
    start = time.perf_counter()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.dup2(w, 1)
        os.close(r)
        os.chdir("/")  # `python -c` puts the working folder first on sys.path: not this checkout
        os.execve(sys.executable, [sys.executable, "-c", code, *args], env)
    os.close(w)
    peak = {"RssAnon": 0, "RssFile": 0}
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            for k, v in _status(pid).items():
                peak[k] = max(peak[k], v)
            done.wait(0.02)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    chunks = []
    while block := os.read(r, 1 << 16):
        chunks.append(block)
    os.close(r)
    _, status, usage = os.wait4(pid, 0)
    wall = time.perf_counter() - start
    done.set()
    poller.join()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"child for {args[0]} failed with status {status}")
    result = json.loads(b"".join(chunks).decode().strip().splitlines()[-1])
    return dict(
        result,
        wall=wall,
        load=load,
        cpu=usage.ru_utime + usage.ru_stime,
        peak_mb=usage.ru_maxrss / 1024,
        anon_mb=peak["RssAnon"] / 1024,
        file_mb=peak["RssFile"] / 1024,
    )


def corpus_path(root: Path, rows: int, short: bool) -> Path:
    """Where the corpus of `rows` rows is written."""
    return root / f"corpus-{'short-' if short else ''}{rows}.jsonl"


def bench(rows: int, root: Path, repeats: int, sources: dict[str, str], short: bool = False) -> list[dict[str, Any]]:
    """pyarrow, then each batchinfer source, `repeats` times alternating; the median run of each, with
    the best in-process time (the least disturbed by other work on the machine)."""
    corpus = corpus_path(root, rows, short)
    if not corpus.exists():
        t = time.perf_counter()
        size = write_corpus(corpus, rows, short=short)
        print(f"generated {corpus}: {size / 1e6:.0f} MB in {time.perf_counter() - t:.0f} s", flush=True)
    model = root / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    runs: dict[str, list[dict[str, Any]]] = {
        "pyarrow": [],
        "pyarrow read_json": [],
        "pyarrow + write": [],
        **{name: [] for name in sources},
    }
    for _ in range(repeats):
        runs["pyarrow"].append(measure(PYARROW, [str(corpus)], str(REPO)))
        runs["pyarrow read_json"].append(measure(PYARROW_READ_JSON, [str(corpus)], str(REPO)))
        runs["pyarrow + write"].append(measure(PYARROW_WRITE, [str(corpus), str(root / "floor.arrow")], str(REPO)))
        for name, src in sources.items():
            out = root / f"run-{len(name)}-{rows}"  # a name Hydra overrides take as it is
            shutil.rmtree(out, ignore_errors=True)
            runs[name].append(measure(BATCHINFER, [str(corpus), str(out), str(model)], src))
            shutil.rmtree(out, ignore_errors=True)
        for name, rs in runs.items():
            print(f"  {rows} rows {name}: {json.dumps(rs[-1])}", flush=True)
    size = corpus.stat().st_size
    result = []
    for name, rs in runs.items():
        med = sorted(rs, key=lambda r: r["inner"])[len(rs) // 2]
        assert med["rows"] == rows, (name, med["rows"])
        best = min(r["inner"] for r in rs)
        cpu = sorted(r.get("inner_cpu", r["cpu"]) for r in rs)[len(rs) // 2]
        extra = {}
        if "prepare_s" in med:
            extra["prepare_median"] = sorted(r["prepare_s"] for r in rs)[len(rs) // 2]
        result.append(
            dict(
                med,
                system=name,
                rows=rows,
                bytes=size,
                best=best,
                cpu_median=cpu,
                inner_all=[r["inner"] for r in rs],
                **extra,
            )
        )
    return result


def table(results: list[dict[str, Any]]) -> str:
    """The results as a Markdown table, each line against pyarrow's read (and read + write) of the same file."""
    lines = [
        "| rows | MB | system | in-process s | best in-process s | prepare alone s | in-process CPU s | process s "
        "| x pyarrow read (in-process) | x pyarrow read (best) | x pyarrow read (prepare alone) "
        "| x pyarrow read (in-process CPU) | x pyarrow read + write (in-process) | peak RSS MB "
        "| RSS after imports MB | peak anon MB | peak file-backed MB | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    read = {r["rows"]: r for r in results if r["system"] == "pyarrow"}
    floor = {r["rows"]: r for r in results if r["system"] == "pyarrow + write"}
    for r in results:
        b, f = read[r["rows"]], floor[r["rows"]]
        alone = r.get("prepare_median", r["inner"])
        lines.append(
            f"| {r['rows']:,} | {r['bytes'] / 1e6:.0f} | {r['system']} | {r['inner']:.2f} | {r['best']:.2f} | {alone:.2f} "
            f"| {r['cpu_median']:.2f} | {r['wall']:.2f} | {r['inner'] / b['inner']:.2f} | {r['best'] / b['best']:.2f} "
            f"| {alone / b['inner']:.2f} | {r['cpu_median'] / b['cpu_median']:.2f} | {r['inner'] / f['inner']:.2f} | {r['peak_mb']:.0f} | {r['start_mb']:.0f} | {r['anon_mb']:.0f} "
            f"| {r['file_mb']:.0f} | {r['load']:.1f} |"
        )
    return "\n".join(lines)


def phases(results: list[dict[str, Any]]) -> str:
    """Where batchinfer's in-process time goes, per run."""
    out = []
    for r in results:
        if "phases" in r:
            parts = ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["phases"].items(), key=lambda kv: -kv[1]))
            out.append(f"- {r['rows']:,} rows, {r['system']}: total {r['inner']:.2f} s; {parts}")
    return "\n".join(out)


def plot(results: list[dict[str, Any]], out: Path) -> None:
    """In-process seconds (median, and the best run) and peak RSS of each system at each size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["rows"] for r in results})
    systems = list(dict.fromkeys(r["system"] for r in results))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(systems)
    for k, system in enumerate(systems):
        at = [i + k * width for i in range(len(sizes))]
        rs = [next((r for r in results if r["rows"] == n and r["system"] == system), None) for n in sizes]
        axes[0].bar(at, [r["inner"] if r else 0 for r in rs], width, label=system)
        axes[0].scatter(at, [r["best"] if r else 0 for r in rs], color="black", s=8, zorder=3)
        axes[1].bar(at, [r["peak_mb"] if r else 0 for r in rs], width, label=system)
    for ax, title in zip(axes, ["in-process s (median; dot: best run)", "peak RSS MB"], strict=True):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(sizes))], [f"{n:,} rows" for n in sizes])
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 10_000_000])
    ap.add_argument("--old-src", help="a checkout of the code before (its folder goes on PYTHONPATH)")
    ap.add_argument("--old-rows", type=int, nargs="*", default=[1_000_000], help="sizes to run the old code on")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/prepare-bench"))
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--keep", action="store_true", help="keep the corpora")
    ap.add_argument("--json", type=Path, help="write the results here too")
    ap.add_argument("--short", action="store_true", help="short rows (~58 bytes: an id and a few words)")
    ap.add_argument("--plot", type=Path, help="a chart of the results (PNG)")
    a = ap.parse_args()
    print(json.dumps(machine()), flush=True)
    a.dir.mkdir(parents=True, exist_ok=True)
    results = []
    try:
        for rows in a.rows:
            sources = {"batchinfer": str(REPO)}
            if a.old_src and rows in a.old_rows:
                sources = {"batchinfer (before)": a.old_src, **sources}
            results += bench(rows, a.dir, a.repeats, sources, a.short)
            if not a.keep:
                corpus_path(a.dir, rows, a.short).unlink()
    finally:
        if not a.keep:
            shutil.rmtree(a.dir, ignore_errors=True)
    print(table(results))
    print()
    print(phases(results))
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    if a.plot:
        plot(results, a.plot)
    for system in ("pyarrow", "batchinfer"):
        runs = [r for r in results if r["system"] == system]
        if len(runs) > 1:
            lo, hi = runs[0], runs[-1]
            per = (hi["rows"] - lo["rows"]) / 1e6
            print(
                f"\n{system}: peak RSS {(hi['peak_mb'] - lo['peak_mb']) / per:+.1f} MB, peak anon "
                f"{(hi['anon_mb'] - lo['anon_mb']) / per:+.1f} MB per 1M rows more, from {lo['rows']:,} "
                f"to {hi['rows']:,} rows"
            )


if __name__ == "__main__":
    main()
