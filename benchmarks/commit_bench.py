"""What a commit costs and what a SIGKILL loses, at a GPU's rate (issue 44, "Work lost to a kill").

Two measurements:

1. `cost`: the worker's own commit (`ShardWorker.commit`: the rows as a table, the part written under
   a temporary name, fsynced, linked to its name, the folder fsynced, then progress.json the same
   way), timed over many commits of a given number of rows, in a fresh process whose run directory
   is on a chosen folder: the local disk, /dev/shm, the filesystem emulations of the tests
   (tests/support/fsemu: NFS's flock as POSIX locks, Lustre's ENOSYS; the shard lock is taken as a
   worker takes it) and a latency model of a shared filesystem (each fsync and each metadata call
   of the commit waits a set time, as an NFS or Lustre round trip would; a model, not a mount).
   From the cost per commit: the share of a task's time that committing takes at a rows/s rate for
   each commit window.
2. `lost`: `batchinfer run` with the stand-in engine (tests/support/standin.py) at a simulated GPU
   rate (BATCHINFER_STANDIN_STEP_SECONDS set so that its steps finish `--rate` rows a second of
   engine time), killed (SIGKILL, the whole process group) at a random moment after its first
   commit: the rows it had finished (BATCHINFER_TRACE) that no part holds are the work a resume
   computes again, said in engine seconds at that rate. Also an uninterrupted run: parts per shard
   and the share of the task's time spent committing (progress.json `seconds`).

`work_lost()` is what benchmarks/ceiling.py can call for its table.
usage: python benchmarks/commit_bench.py cost [--root /tmp/commit-bench] [--rows 1 100 1000 10000]
       python benchmarks/commit_bench.py lost [--rate 2000] [--kills 5] [--rows 60000] [-- overrides...]
       python benchmarks/commit_bench.py all --md benchmarks/results/commit.md [--json ...]
"""

from __future__ import annotations

import argparse
import builtins
import json
import os
import random
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TESTS = REPO / "tests"
sys.path.insert(0, str(HERE))

from _common import machine  # noqa: E402

# A shared filesystem's round trips, as a model: NFS/Lustre metadata calls (create, link, rename,
# unlink) ~1-2 ms to the server and back, an fsync (NFS COMMIT, Lustre OST sync) ~5-10 ms. The
# higher ends, so that the window chosen holds on a slow shared filesystem too.
SHARED_LATENCY = {"fsync_ms": 10.0, "meta_ms": 2.0}


# ---------------------------------------------------------------- 1. the cost of a commit


def output_row(r: int) -> dict[str, Any]:
    """A generated row as the worker commits it: a 16-token answer, its counts and request digest."""
    return {
        "row": r,
        "id": f"doc-{r:08d}",
        "text": f"answer {r}: " + "word " * 14,
        "finish_reason": "length" if r % 4 == 0 else "stop",
        "prompt_tokens": 200 + r % 50,
        "output_tokens": 16,
        "error": None,
        "request_digest": f"{r:032x}",
        "reused": False,
    }


def _slow_calls(fsync_ms: float, meta_ms: float) -> None:
    """Make this process's fsyncs and metadata calls wait as a shared filesystem's round trips do."""

    def slowed(fn: Any, ms: float) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            time.sleep(ms / 1000)
            return fn(*a, **k)

        return call

    os.fsync = slowed(os.fsync, fsync_ms)
    for name in ("link", "replace", "rename", "unlink"):
        setattr(os, name, slowed(getattr(os, name), meta_ms))
    real_open = builtins.open

    def opening(file: Any, mode: str = "r", *a: Any, **k: Any) -> Any:
        if any(c in mode for c in "wax"):  # a file created: one more round trip
            time.sleep(meta_ms / 1000)
        return real_open(file, mode, *a, **k)

    builtins.open = opening  # type: ignore[assignment]


def cost_child(root: Path, fmt: str, rows_per_commit: list[int], commits: int, latency: Optional[dict]) -> None:
    """In a fresh process: a run directory under root, shard 0's lock held as a worker holds it, then
    `commits` commits of each size through ShardWorker.commit; prints one JSON line."""
    import types

    from _common import prepared_run

    from batchinfer.engine.worker import ShardWorker
    from batchinfer.locks import ShardLock
    from batchinfer.rundir.progress import Progress

    root.mkdir(parents=True, exist_ok=True)
    total = sum(rows_per_commit) * commits
    run, _ = prepared_run(root, total, fmt, "sharding.num_shards=1")
    shard = run.shards()[0]
    folder = run.shard_folder(0)
    folder.path.mkdir(parents=True, exist_ok=True)
    if latency:
        _slow_calls(**latency)
    # The worker's own commit, on a stand-in for the worker (it uses these attributes only).
    worker = types.SimpleNamespace(run=run, bar=None, engine_record=None, stop=types.SimpleNamespace(signum=None))
    worker._engine_dead = lambda: False
    worker.write_progress = types.MethodType(ShardWorker.write_progress, worker)
    record = Progress(shard=0, rows_total=shard.rows)
    out: dict[str, Any] = {"fmt": fmt, "latency": latency, "sizes": {}}
    r = 0
    with ShardLock(folder.path, mode="auto", log=lambda _: None):
        for n in rows_per_commit:
            seconds = []
            for _ in range(commits):
                rows = [output_row(i) for i in range(r, r + n)]
                r += n
                t = time.perf_counter()
                ShardWorker.commit(worker, shard, rows, record)  # type: ignore[arg-type]
                seconds.append(time.perf_counter() - t)
            out["sizes"][n] = {
                "median_s": statistics.median(seconds),
                "p90_s": sorted(seconds)[int(0.9 * (len(seconds) - 1))],
                "bytes": sum(p.stat().st_size for p in folder.part_files()) / max(record.parts, 1),
            }
    out["parts"] = record.parts
    print(json.dumps(out))


@dataclass
class Place:
    """Where commits are measured: a folder, and what the child process runs with."""

    name: str
    root: Path
    flock: Optional[str] = None  # tests/support/fsemu's mode
    latency: Optional[dict[str, float]] = None


def places(base: Path) -> list[Place]:
    """Local disk, tmpfs, the flock emulations, and the shared-filesystem latency model."""
    return [
        Place("local disk (ext4)", base / "local"),
        Place("tmpfs (/dev/shm)", Path(tempfile.mkdtemp(prefix="commit-bench-", dir="/dev/shm"))),
        Place("NFS flock emulation (fsemu nfs)", base / "nfs", flock="nfs"),
        Place("Lustre noflock emulation (fsemu enosys)", base / "enosys", flock="enosys"),
        Place(
            f"shared-FS latency model ({SHARED_LATENCY['fsync_ms']:g} ms fsync, {SHARED_LATENCY['meta_ms']:g} ms metadata)",
            base / "shared",
            flock="nfs",
            latency=SHARED_LATENCY,
        ),
    ]


def measure_cost(place: Place, fmt: str, sizes: list[int], commits: int) -> dict[str, Any]:
    """One child process's commit timings at place."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(HERE)]))
    if place.flock:
        env.update(
            PYTHONPATH=os.pathsep.join([str(TESTS / "support" / "fsemu"), env["PYTHONPATH"]]),
            BATCHINFER_TEST_FLOCK=place.flock,
            BATCHINFER_TEST_FLOCK_ROOT=str(place.root),
            BATCHINFER_TEST_FLOCK_LOG=str(place.root.with_name(place.root.name + "-flock.log")),
        )
    shutil.rmtree(place.root, ignore_errors=True)
    args = ["cost-child", str(place.root), fmt, json.dumps(sizes), str(commits), json.dumps(place.latency)]
    done = subprocess.run(
        [sys.executable, __file__, *args], env=env, capture_output=True, text=True, timeout=1800, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"commit child at {place.name} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    flock_log = place.root.with_name(place.root.name + "-flock.log")
    if place.flock:  # the proof that the emulation was in force on this run directory
        result["emulated_flock_calls"] = len(flock_log.read_text().splitlines()) if flock_log.exists() else 0
        flock_log.unlink(missing_ok=True)
    shutil.rmtree(place.root, ignore_errors=True)
    return dict(result, place=place.name)


def cost_table(results: list[dict[str, Any]], rate: float, windows: list[float]) -> str:
    """Seconds per commit by part size, and the share of a task's time committing takes at `rate`
    rows/s for each window (cost of a commit of rate x window rows, over window)."""
    sizes = sorted({int(n) for r in results for n in r["sizes"]})
    head = "| where | format | " + " | ".join(f"{n:,} rows: ms" for n in sizes)
    head += " | " + " | ".join(f"share at {w:g} s" for w in windows) + " |"
    lines = [head, "|" + "---|" * (2 + len(sizes) + len(windows))]
    for r in results:
        ms = {int(n): v["median_s"] * 1000 for n, v in r["sizes"].items()}
        shares = []
        for w in windows:
            n = rate * w  # rows per commit: interpolated between the sizes measured
            lo = max((s for s in sizes if s <= n), default=sizes[0])
            hi = min((s for s in sizes if s >= n), default=sizes[-1])
            c = ms[lo] if hi == lo else ms[lo] + (ms[hi] - ms[lo]) * (n - lo) / (hi - lo)
            shares.append(f"{c / 1000 / w:.2%}")
        lines.append(
            f"| {r['place']} | {r['fmt']} | "
            + " | ".join(f"{ms[n]:.1f}" for n in sizes)
            + " | "
            + " | ".join(shares)
            + " |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------- 2. work lost to a SIGKILL


@dataclass
class Lost:
    """One killed run: rows finished and committed at the kill, and what the difference costs."""

    finished_rows: int
    committed_rows: int
    lost_rows: int
    lost_engine_s: float  # lost rows at the simulated rate
    since_last_commit_s: float
    parts: int
    achieved_rows_per_s: float  # what the worker and stand-in together made (the worker's CPU decides here)


def _parts(out: Path) -> list[Path]:
    return sorted(out.glob("shards/*/part-*"), key=lambda p: p.stat().st_mtime)


def _committed_files(out: Path, shard: Optional[int] = None) -> list[Path]:
    """The committed files of a run directory (of one shard) as batchinfer reads them: a shard's
    parts, or once it is sealed the compacted file its DONE.json names."""
    from batchinfer.rundir.store import RunDir

    run = RunDir(out)
    return [p for s in run.shards() if shard in (None, s.index) for p in run.shard_folder(s.index).committed_files()]


def _part_rows(path: Path) -> int:
    if path.suffix == ".jsonl":
        return sum(1 for line in path.read_bytes().splitlines() if line.strip())
    import pyarrow.parquet as pq

    return pq.read_metadata(path).num_rows


def _corpus(root: Path, rows: int) -> Path:
    """rows short prompts (~30 tokens), unique."""
    path = root / "corpus.jsonl"
    words = "the of and to in is was for on that with as by at from it an be this which or are".split()
    with open(path, "w") as f:
        for i in range(rows):
            text = " ".join(words[(i >> k) % len(words)] for k in range(0, 24, 2))
            f.write(json.dumps({"id": f"r{i:08d}", "text": f"{text} ({i})"}) + "\n")
    return path


def _standin_model(root: Path) -> Path:
    """The tests' tiny model folder (the stand-in only needs its tokenizer and chat template)."""
    sys.path.insert(0, str(TESTS))
    from support.tiny_model import build

    return build(root / "tiny-model")


def _run_cmd(corpus: Path, model: Path, out: Path, max_seqs: int, overrides: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "batchinfer.cli",
        "run",
        f"input.path={corpus}",
        "input.id_column=id",
        f"model.path={model}",
        "model.max_model_len=512",
        f"model.max_num_seqs={max_seqs}",
        "sampling.max_tokens=16",
        f"output.dir={out}",
        *overrides,
    ]


def _env(trace: Path, step_s: float) -> dict[str, str]:
    sys.path.insert(0, str(TESTS))
    from support.standin import STEP_ENV, standin_env

    env = standin_env(dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])))
    return dict(env, BATCHINFER_TRACE=str(trace), **{STEP_ENV: f"{step_s:.6f}"})


def _rows_done(points: list[tuple[float, int]]) -> int:
    """Rows finished over all shards of a trace (each shard's count starts again from 0)."""
    ends = [a[1] for a, b in zip(points, points[1:], strict=False) if b[1] < a[1]]
    return sum(ends) + points[-1][1]


def _trace(trace: Path) -> list[tuple[float, int]]:
    return [(float(t), int(n)) for t, n in (ln.split() for ln in trace.read_text().splitlines() if ln.strip())]


def calibrate(root: Path, corpus: Path, model: Path, max_seqs: int, overrides: list[str]) -> float:
    """Rows the stand-in finishes per step with max_seqs (a short run at a fixed step time)."""
    out, trace = root / "calibrate", root / "calibrate-trace.txt"
    shutil.rmtree(out, ignore_errors=True)
    trace.unlink(missing_ok=True)
    cmd = _run_cmd(corpus, model, out, max_seqs, overrides)
    subprocess.run(cmd, env=_env(trace, 0.001), check=True, capture_output=True, timeout=1800)
    points = _trace(trace)
    shutil.rmtree(out, ignore_errors=True)
    return points[-1][1] / len(points)


def one_kill(
    root: Path, corpus: Path, model: Path, rate: float, step_s: float, max_seqs: int, overrides: list[str], rng: Any
) -> Lost:
    """Run, SIGKILL the group at a random moment after the first commit, count what was lost."""
    out, trace = root / "killed", root / "trace.txt"
    shutil.rmtree(out, ignore_errors=True)
    trace.unlink(missing_ok=True)
    cmd = _run_cmd(corpus, model, out, max_seqs, overrides)
    proc = subprocess.Popen(
        cmd, env=_env(trace, step_s), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    while not _parts(out):
        if proc.poll() is not None:
            raise SystemExit("the run ended before its first commit: give it more rows")
        time.sleep(0.02)
    time.sleep(rng.uniform(1.0, 12.0))
    if proc.poll() is not None:
        raise SystemExit("the run ended before the kill: give it more rows")
    t_kill = time.time()
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    committed = _committed_files(out)
    points = _trace(trace)
    # The trace counts the rows finished in the shard being worked on (from 0 at each shard, shards in
    # order): the last count is that shard's, compared with what that shard committed.
    shard = sum(1 for a, b in zip(points, points[1:], strict=False) if b[1] < a[1])
    finished = points[-1][1]
    rows_committed = sum(_part_rows(p) for p in _committed_files(out, shard))
    t0 = points[0][0]
    lost = finished - rows_committed
    return Lost(
        finished_rows=finished,
        committed_rows=rows_committed,
        lost_rows=lost,
        lost_engine_s=lost / rate,
        since_last_commit_s=t_kill - max(p.stat().st_mtime for p in committed),
        parts=sum(1 for p in committed if p.name.startswith("part-")),
        achieved_rows_per_s=_rows_done(points) / max(points[-1][0] - t0, 1e-9),
    )


def whole_run(
    root: Path, corpus: Path, model: Path, step_s: float, max_seqs: int, overrides: list[str]
) -> dict[str, Any]:
    """An uninterrupted run: parts per shard, seconds committing against the task's, as progress.json says."""
    out, trace = root / "whole", root / "whole-trace.txt"
    shutil.rmtree(out, ignore_errors=True)
    trace.unlink(missing_ok=True)
    t = time.perf_counter()
    cmd = _run_cmd(corpus, model, out, max_seqs, overrides)
    subprocess.run(cmd, env=_env(trace, step_s), check=True, capture_output=True, timeout=3600)
    wall = time.perf_counter() - t
    done = [json.loads(p.read_text()) for p in sorted(out.glob("shards/*/DONE.json"))]
    commit_s = sum(d["seconds"].get("commit", 0) for d in done)
    task_s = sum(sum(v for v in d["seconds"].values() if isinstance(v, (int, float))) for d in done)
    parts = [d.get("parts") for d in done]
    shutil.rmtree(out, ignore_errors=True)
    return {"wall_s": wall, "commit_s": commit_s, "task_s": task_s, "commit_share": commit_s / task_s, "parts": parts}


def work_lost(
    rate: float = 2000.0,
    kills: int = 5,
    rows: int = 60_000,
    max_seqs: int = 64,
    overrides: Optional[list[str]] = None,
    seed: int = 0,
) -> dict[str, Any]:
    """SIGKILLs at random moments of `batchinfer run` on the stand-in engine at `rate` rows/s of engine
    time; each kill's lost rows and engine seconds, the worst, and an uninterrupted run's commit share
    and parts. overrides: more config (e.g. output.commit_every_seconds=...)."""
    overrides = list(overrides or [])
    root = Path(tempfile.mkdtemp(prefix="commit-lost-"))
    try:
        corpus = _corpus(root, rows)
        model = _standin_model(root)
        (root / "cal").mkdir()
        per_step = calibrate(root, _corpus(root / "cal", 4000), model, max_seqs, overrides)
        step_s = per_step / rate
        rng = random.Random(seed)
        killed = [one_kill(root, corpus, model, rate, step_s, max_seqs, overrides, rng) for _ in range(kills)]
        whole = whole_run(root, corpus, model, step_s, max_seqs, overrides)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {
        "rate": rate,
        "rows_per_step": per_step,
        "step_seconds": step_s,
        "overrides": overrides,
        "kills": [asdict(k) for k in killed],
        "worst_lost_engine_s": max(k.lost_engine_s for k in killed),
        "whole": whole,
    }


def lost_table(runs: dict[str, dict[str, Any]]) -> str:
    """One line per policy: lost engine seconds per kill (worst), commit share, parts."""
    lines = [
        "| policy | rows lost per kill | engine s lost per kill (at the rate) | worst | since last commit s "
        "| achieved rows/s | parts (uninterrupted) | commit share of the task |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in runs.items():
        ks = r["kills"]
        rows = ", ".join(str(k["lost_rows"]) for k in ks)
        engine_s = ", ".join(f"{k['lost_engine_s']:.2f}" for k in ks)
        since = ", ".join(f"{k['since_last_commit_s']:.1f}" for k in ks)
        achieved = statistics.median(k["achieved_rows_per_s"] for k in ks)
        lines.append(
            f"| {name} | {rows} | {engine_s} | {r['worst_lost_engine_s']:.2f} | {since} | {achieved:.0f} "
            f"| {r['whole']['parts']} | {r['whole']['commit_share']:.2%} |"
        )
    return "\n".join(lines)


def main() -> None:
    if sys.argv[1:2] == ["cost-child"]:
        root, fmt, sizes, commits, latency = sys.argv[2:7]
        cost_child(Path(root), fmt, json.loads(sizes), int(commits), json.loads(latency))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["cost", "lost", "all"])
    ap.add_argument("--root", type=Path, default=Path("/tmp/commit-bench"))
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 100, 1000, 10000])
    ap.add_argument("--commits", type=int, default=30)
    ap.add_argument("--formats", nargs="+", default=["parquet", "jsonl"])
    ap.add_argument("--rate", type=float, default=2000.0, help="simulated GPU rows/s")
    ap.add_argument("--windows", type=float, nargs="+", default=[0.25, 1, 2, 5, 60])
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--rows", type=int, default=60_000)
    ap.add_argument("--max-seqs", type=int, default=64)
    ap.add_argument("--policy", action="append", default=[], help="NAME=override,override (repeatable)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--md", type=Path, help="write the machine, the command and the tables here")
    a = ap.parse_args()
    print(json.dumps(machine()), flush=True)
    results: dict[str, Any] = {"machine": machine(), "load_1min": [os.getloadavg()[0]]}
    if a.what in ("cost", "all"):
        a.root.mkdir(parents=True, exist_ok=True)
        cost = [measure_cost(p, fmt, a.sizes, a.commits) for p in places(a.root) for fmt in a.formats]
        results["cost"] = cost
        print(cost_table(cost, a.rate, a.windows), flush=True)
    if a.what in ("lost", "all"):
        policies = {"defaults": []}
        for spec in a.policy:
            name, _, rest = spec.partition("=")
            policies[name] = [o for o in rest.split(",") if o]
        lost = {name: work_lost(a.rate, a.kills, a.rows, a.max_seqs, o) for name, o in policies.items()}
        results["lost"] = lost
        print(lost_table(lost), flush=True)
    results["load_1min"].append(os.getloadavg()[0])  # 2 cores: above ~2, other work was running
    if a.json:
        a.json.write_text(json.dumps(results, indent=1, default=str))
    if a.md:
        a.md.write_text(report(results, a))


def _load(results: dict[str, Any]) -> str:
    """The machine's load average before and after the measurements."""
    load = results.get("load_1min") or []
    return "-".join(f"{x:.1f}" for x in load) or "not recorded"


def report(results: dict[str, Any], a: argparse.Namespace) -> str:
    """The results as markdown: the machine, the command, the cost table and the kill table."""
    m = results["machine"]
    flags = ", ".join(f for f, on in m["flags"].items() if on)
    lines = [
        "# What a commit costs and what a SIGKILL loses (issue 44)",
        "",
        f"Measured {m['date']} on {m['cpu']} ({m['cores']} cores, {m['mem_gb']} GB; flags: {flags}), "
        f"versions {m['versions']}; 1-minute load average {_load(results)} (before-after: above ~2, other "
        "work shared the machine and the figures are slower than on an idle one).",
        "",
        "    python benchmarks/commit_bench.py " + shlex.join(sys.argv[1:]),
        "",
    ]
    if "cost" in results:
        lines += [
            "## The cost of one commit",
            "",
            "`ShardWorker.commit` itself: the part written under a temporary name, fsynced, linked to its",
            "name, the folder fsynced, then progress.json the same way (median of "
            f"{a.commits} commits per size). The share columns: a commit of {a.rate:g} rows/s x window",
            "rows every window seconds, against the window (interpolated between the sizes measured).",
            "The emulations: tests/support/fsemu (NFS's flock as POSIX locks, Lustre's ENOSYS) on the",
            "local disk; the latency model adds the waits given to each fsync and each metadata call",
            "(a model of a shared filesystem's round trips, not a mount).",
            "",
            cost_table(results["cost"], a.rate, a.windows),
            "",
        ]
        calls = [
            f"{r['place']} ({r['fmt']}): {r['emulated_flock_calls']}"
            for r in results["cost"]
            if "emulated_flock_calls" in r
        ]
        if calls:
            lines += ["Emulated lock calls seen (proof the emulation was in force): " + "; ".join(calls) + ".", ""]
    if "lost" in results:
        r0 = next(iter(results["lost"].values()))
        lines += [
            "## Work lost to a SIGKILL at a simulated GPU rate",
            "",
            f"`batchinfer run` with the stand-in engine, its step time set so that steps finish {a.rate:g} rows",
            f"a second of engine time ({r0['rows_per_step']:.0f} rows a step, {r0['step_seconds'] * 1000:.1f} ms a step),",
            f"{a.rows:,} short rows, `sharding` default, killed (SIGKILL, the process group) {a.kills} times",
            "at a random moment 1-12 s after the first part; rows lost = rows the shard had finished",
            "(BATCHINFER_TRACE) that no committed file holds. Achieved rows/s is what the worker and the",
            "stand-in made together on this machine (the worker's CPU decides it here, not the rate).",
            "The commit share is progress seconds `commit` over the task's seconds in an uninterrupted run.",
            "",
            lost_table(results["lost"]),
            "",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
