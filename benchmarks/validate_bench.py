"""`batchinfer validate` on a large JSONL: --jobs 1, --jobs N (the allowed CPUs) and --sample.

Generates a corpus (benchmarks/gen_corpus.py, ~415 bytes a row), runs the real CLI in a subprocess
for each setting and reports wall time, rows checked per second, the ratio to --jobs 1, and the
peak memory of the process tree (validate and its worker processes, polled from /proc: the sum of RSS, which counts
the memory-mapped dataset once per process, and the sum of PSS, which shares it out). A run with
`--sample 1` measures the part every run pays whatever it checks (start, JSONL conversion, ids), so
the tokenizing rate shows apart from it. Checks that --jobs N reports exactly what --jobs 1 does.
usage: python benchmarks/validate_bench.py [--rows 200000 1000000] [--sample 10000] [--model DIR]
       [--out benchmarks/results/validate.md]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import gen_corpus  # noqa: E402  (the scale benchmarks' shared corpus)

PAGE = os.sysconf("SC_PAGE_SIZE")


def _children(pid: int) -> list[int]:
    """pid's child processes, from each of its threads' children file (no scan of all of /proc)."""
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            out += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    except OSError:  # the process just ended
        pass
    return out


def _tree(root: int) -> list[int]:
    """root and every process below it."""
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += _children(pid)
    return out


def _memory(pids: list[int]) -> tuple[int, int, int]:
    """Sums of RSS, PSS and anonymous RSS (bytes) of the processes."""
    rss = pss = anon = 0
    for pid in pids:
        try:
            rss += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    pss += int(line.split()[1]) * 1024
                    break
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("RssAnon:"):
                    anon += int(line.split()[1]) * 1024
                    break
        except (OSError, IndexError, ValueError):  # the process just ended
            continue
    return rss, pss, anon


def run_validate(args: list[str], poll: float = 0.5) -> dict[str, Any]:
    """The CLI's JSON report, its wall time and the process tree's peak memory."""
    cmd = [sys.executable, "-m", "batchinfer.cli", "validate", "--json", *args]
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    peak = [0, 0, 0]
    while proc.poll() is None:
        peak = [max(a, b) for a, b in zip(peak, _memory(_tree(proc.pid)), strict=True)]
        time.sleep(poll)
    out, err = proc.communicate()
    seconds = time.perf_counter() - t0
    if proc.returncode not in (0, 1):
        raise SystemExit(f"validate failed ({proc.returncode}): {' '.join(cmd)}\n{err}")
    # The machine may be shared: the 1-minute load before and after says whether others ran too.
    loads = (load, os.getloadavg()[0])
    rss, pss, anon = peak
    return {"report": json.loads(out), "seconds": seconds, "rss": rss, "pss": pss, "anon": anon, "load": loads}


def default_model(root: Path) -> Path:
    """SmolLM2 when `batchinfer prepare-model` has prepared it, else the tests' tiny model (built here)."""
    from batchinfer.models.locations import models_home

    smol = models_home() / "SmolLM2-135M-Instruct"
    if (smol / "tokenizer.json").is_file():
        return smol
    sys.path.insert(0, str(REPO / "tests" / "support"))
    import tiny_model

    return tiny_model.build(root / "tiny-model")


def bench(rows: int, model: Path, root: Path, jobs: int, sample: int) -> list[dict[str, Any]]:
    """Every setting on one corpus of `rows` rows."""
    corpus = root / f"corpus-{rows}.jsonl"
    size = gen_corpus.write(corpus, rows)
    common = [f"input.path={corpus}", "input.id_column=id", f"model.path={model}", f"output.dir={root}/runs"]
    settings: list[tuple[str, list[str], int]] = [
        ("--sample 1 (fixed part)", ["--jobs", "1", "--sample", "1"], 1),
        ("--jobs 1", ["--jobs", "1"], rows),
        (f"--jobs {jobs}", ["--jobs", str(jobs)], rows),
        (f"--sample {sample:,}", ["--sample", str(sample)], min(sample, rows)),
    ]
    results, reports = [], {}
    for name, flags, checked in settings:
        r = run_validate([*flags, *common])
        reports[name] = r["report"]
        results.append(
            {
                "rows": rows,
                "corpus_mb": round(size / 1e6),
                "setting": name,
                "command": f"batchinfer validate {' '.join(flags)} input.path=CORPUS input.id_column=id model.path=MODEL",
                "checked": checked,
                "seconds": round(r["seconds"], 2),
                "peak_rss_mb": round(r["rss"] / 2**20),
                "peak_pss_mb": round(r["pss"] / 2**20),
                "peak_anon_mb": round(r["anon"] / 2**20),
                "load": [round(x, 2) for x in r["load"]],
            }
        )
        print(json.dumps(results[-1]), flush=True)
    if reports["--jobs 1"] != reports[f"--jobs {jobs}"]:
        raise SystemExit(f"--jobs {jobs} reported something else than --jobs 1 on {rows} rows")
    fixed, one = results[0]["seconds"], results[1]
    for r in results[1:]:
        r["rows_s"] = round(r["checked"] / r["seconds"])
        r["tokenize_rows_s"] = round(r["checked"] / max(r["seconds"] - fixed, 1e-9))
        r["ratio"] = round(one["seconds"] / r["seconds"], 2)  # time of --jobs 1 / this one's
    return results


def markdown(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The results page."""
    lines = [
        "# `batchinfer validate`: processes and samples",
        "",
        f"Measured {meta['date']} by `{meta['command']}` on {meta['cpu']} ({meta['cpus']} CPUs allowed, "
        f"{os.cpu_count()} online), Python {meta['python']}, model `{meta['model']}` (its tokenizer and chat "
        "template, chat mode). Corpus: `benchmarks/gen_corpus.py`, ~415 bytes a row (id, ~300 characters of text, "
        "nested meta). "
        "Each setting runs the real CLI once in a subprocess: `batchinfer validate --json SETTING "
        "input.path=CORPUS input.id_column=id model.path=MODEL`.",
        "",
        "- wall: the whole command (start, JSONL conversion, id check, tokenizing every checked row).",
        "- fixed part: `--sample 1`, what every run pays whatever it checks; tokenize rows/s = rows checked "
        "/ (wall - fixed part).",
        "- speedup: wall of `--jobs 1` / wall of the setting.",
        "- peak memory: the process tree (validate and its workers) polled every 0.5 s, each column's own "
        "peak. RSS summed counts the memory-mapped dataset once per process that read it; PSS shares those "
        "pages out; anon is RssAnon, the memory that is not file pages (the mapped dataset is file pages, "
        "which the kernel can drop and read again).",
        f"- `--jobs {meta['jobs']}` reported exactly what `--jobs 1` did (checked by the harness).",
        "- load: the 1-minute load average before and after the setting ran (this run alone: about 1 for "
        "`--jobs 1`, 2 for 2 processes; more means other work shared the CPUs).",
        "",
        "| rows | setting | rows checked | wall s | rows/s | tokenize rows/s | speedup | peak RSS MB | peak PSS MB "
        "| peak anon MB | load |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        rate = f"{r['rows_s']:,}" if "rows_s" in r else ""
        tok = f"{r['tokenize_rows_s']:,}" if "tokenize_rows_s" in r else ""
        ratio = f"{r['ratio']:.2f}x" if "ratio" in r else ""
        lines.append(
            f"| {r['rows']:,} | {r['setting']} | {r['checked']:,} | {r['seconds']:.1f} | {rate} | {tok} | {ratio} "
            f"| {r['peak_rss_mb']:,} | {r['peak_pss_mb']:,} | {r['peak_anon_mb']:,} "
            f"| {r['load'][0]:.2f} -> {r['load'][1]:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    """Generate, run every setting on every size, print JSON lines, write the results page."""
    from batchinfer.insight.cpus import allowed_cpus

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[200_000])
    ap.add_argument("--sample", type=int, default=10_000)
    ap.add_argument("--jobs", type=int, default=allowed_cpus(), help="the parallel setting (default: allowed CPUs)")
    ap.add_argument("--model", type=Path, help="model folder (default: SmolLM2 if prepared, else the tiny model)")
    ap.add_argument("--out", type=Path, help="write the results page here (e.g. benchmarks/results/validate.md)")
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="validate-bench-"))
    try:
        model = a.model or default_model(root)
        results = [r for rows in a.rows for r in bench(rows, model, root, a.jobs, a.sample)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    meta = {
        "date": datetime.date.today().isoformat(),
        "command": "python benchmarks/validate_bench.py " + " ".join(sys.argv[1:]),
        "cpu": cpu,
        "cpus": allowed_cpus(),
        "jobs": a.jobs,
        "python": sys.version.split()[0],
        "model": model.name,
    }
    print(json.dumps({"meta": meta}))
    if a.out:
        a.out.write_text(markdown(results, meta))


if __name__ == "__main__":
    main()
