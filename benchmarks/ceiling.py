"""The pipeline's own ceiling (issue 44): what the worker costs per row when the engine is as fast
as a GPU, beside what a plain vLLM script pays to preprocess the same rows.

Each measurement is a fresh child process pinned to --cores CPUs. It prepares a run directory over
a synthetic chat corpus, runs the real worker (`launch.local.run_shards`: streaming, dedup, work
order, commits, compaction) on the stand-in engine (tests/support/standin.py, the model's real
tokenizer and chat template) and merges. The stand-in either answers at once (`--engine none`: the
worker alone) or takes a step time that makes it finish --gpu-rate rows/s when its queue is full
(`--engine gpu`: it finishes about a third of the 2 x max_num_seqs requests in flight per step).
Measured per run:
- task rows/s (the shards' wall time), the worker's own CPU per row (the process's CPU over the
  shards minus the stand-in's own, which a GPU would do), by phase where the code times its
  phases (batchinfer.engine.phases; with --code at an older checkout only the totals, commit,
  compaction and merge, which this script times around the worker's calls);
- the engine's idle time between steps (the worker's time between two `step()` calls; with a
  synchronous stand-in every such second is a second a GPU would wait) and the steps that started
  with fewer requests in flight than the worker's target (the worker had none ready);
- where the worker's threads wait: the main thread for the next made slice (the helper is the
  slower), the helper for the tokenizer thread (tokenizing is the slower);
- peak RSS during the shards (VmHWM, reset after start-up), and a digest of the merged output
  (the same rows and bytes whatever the code and cores).
Beside it, on one core, the same rows through what a plain script pays before vLLM computes
anything: the chat template rendered row by row and the texts tokenized in one batch call of the
tokenizer ("bare", the target's yardstick: the worker's own CPU per row at most 1.5x it), and over
the first --plain-rows rows also render + tokenize one row at a time and vLLM's own `LLM.chat`
preprocessing (its renderer's `render_chat`, without an engine).
Last, work lost to a SIGKILL at the simulated rate (benchmarks/commit_bench.py's `work_lost`:
`batchinfer run` on the stand-in, killed at random moments; --kills 0 leaves it out).

usage: python benchmarks/ceiling.py [--rows 20000] [--gpu-rate 2000] [--prompts short long]
       [--dups 0 0.1] [--runs cpu1 cpu2 gpu2] [--kills 2] [--code DIR --code-label before]
       [--no-plain] [--dir /tmp/ceiling-bench] [--out benchmarks/results]
The default 20,000 rows per configuration keeps the whole benchmark near 10 minutes on a loaded
2-core machine; the issue's 100k and 1M figures: --rows 100000, --rows 1000000 (5x, 50x the time).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
MAX_NUM_SEQS = 256  # vLLM's default on a GPU
MAX_TOKENS = 16  # the short answers
# The measurements: engine time, cores, the tokenizer's own thread pool. cpu1 gives the phases
# (the pool off: each phase's CPU is its own thread's), cpu2 the rows/s two cores reach, gpu2 the
# engine's idle time at the simulated GPU rate.
RUNS = {
    "cpu1": {"engine": "none", "cores": 1, "pool": False},
    "cpu2": {"engine": "none", "cores": 2, "pool": True},
    "gpu2": {"engine": "gpu", "cores": 2, "pool": True},
}
QUESTIONS = [
    "In two sentences, what does Python's {name} do?",
    "Give one short example call of Python's {name}.",
    "What is a common mistake when using Python's {name}?",
    "Explain Python's {name} to a beginner in one sentence.",
]
TARGET_CPU = 1.5  # the worker's own CPU per row, at most this times the bare render + batch tokenize
KILL_ROWS = 40_000  # rows of the killed runs at least
TARGET_CORES = 1.6  # rows/s with two cores, at least this times one core's
PHASE_ORDER = ("read", "request", "render", "tokenize", "digest", "dedup", "order", "submit", "collect")


# ----------------------------------------------------------------------------- corpus


def sentences() -> tuple[list[str], list[str]]:
    """(function names, docstring sentences) of the standard library, in a fixed order."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from profiles import functions

    names, found = [], set()
    for name, doc, _ in functions():
        names.append(name)
        for part in re.split(r"(?<=[.!?])\s+", " ".join(doc.split())):
            if 20 <= len(part) <= 300:
                found.add(part)
    return names, sorted(found)


def corpus(path: Path, rows: int, kind: str, dup: float, seed: int = 0) -> Path:
    """JSONL rows {id, text}: a question about a function and one sentence (short, ~40 prompt
    tokens with the chat template) or eight sentences (long, ~210); a share `dup` of rows repeat
    an earlier row's text (a random earlier row: near, in the same window, or far)."""
    if path.is_file():
        return path
    rng = random.Random(seed)
    names, pool = sentences()
    texts: list[str] = []
    with path.open("w") as f:
        for i in range(rows):
            if i and rng.random() < dup:
                text = texts[rng.randrange(i)]
            else:
                q = rng.choice(QUESTIONS).format(name=rng.choice(names))
                n = 1 if kind == "short" else 8
                text = f"{q} {' '.join(rng.choice(pool) for _ in range(n))} (ref {i})"
            texts.append(text)
            f.write(json.dumps({"id": f"r{i:08d}", "text": text}) + "\n")
    return path


# ----------------------------------------------------------------------------- the child


def _status(key: str) -> int:
    """A /proc/self/status figure in kB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


class TimedEngine:
    """The stand-in, its own CPU seconds counted apart (a GPU does that work) and its steps timed."""

    OWN = ("add", "step", "abort_all", "has_unfinished", "sampling_params")

    def __init__(self, inner: Any, target: int):
        self._inner = inner
        self._target = target  # requests the worker keeps in flight
        self.own_cpu: dict[str, float] = {}  # method -> CPU seconds inside it
        # per step: start, end, requests queued at its start and after it, requests added before it
        self.steps: list[tuple[float, float, int, int, int]] = []
        self._adds = 0

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if name not in self.OWN or not callable(value):
            return value

        def timed(*args: Any, **kwargs: Any) -> Any:
            c0, t0 = time.thread_time(), time.perf_counter()
            queued = len(self._inner.queue)
            try:
                return value(*args, **kwargs)
            finally:
                self.own_cpu[name] = self.own_cpu.get(name, 0.0) + time.thread_time() - c0
                if name == "add":
                    self._adds += 1
                elif name == "step":
                    self.steps.append((t0, time.perf_counter(), queued, len(self._inner.queue), self._adds))
                    self._adds = 0

        return timed

    def idle(self) -> dict[str, Any]:
        """Seconds between steps, the steps' own seconds, and the steps that began with fewer
        requests than the worker keeps in flight although more of the shard's were still to come
        (a shard's tail, after its last request, does not count)."""
        s = self.steps
        busy = sum(b - a for a, b, *_ in s)
        gaps = [s[i + 1][0] - s[i][1] for i in range(len(s) - 1)]
        tail = [False] * len(s)  # after the last request of a shard, until its queue is empty
        for i in range(len(s) - 1, -1, -1):
            ends = s[i][3] == 0 or i == len(s) - 1
            tail[i] = ends or (tail[i + 1] and s[i + 1][4] == 0)
        short = sum(1 for i, step in enumerate(s) if step[2] < self._target and not tail[i])
        return {
            "steps": len(s),
            "busy_s": busy,
            "idle_s": sum(gaps),
            "idle_max_s": max(gaps, default=0.0),
            "idle_share": sum(gaps) / (busy + sum(gaps)) if s else None,
            "steps_short": short,
        }


def wrap_cpu(owner: Any, attr: str, into: dict[str, float], name: str) -> None:
    """Count the calling thread's CPU and wall seconds in owner.attr under `name`."""
    real = getattr(owner, attr)

    def timed(*args: Any, **kwargs: Any) -> Any:
        c0, t0 = time.thread_time(), time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            into[f"{name}_cpu_s"] = into.get(f"{name}_cpu_s", 0.0) + time.thread_time() - c0
            into[f"{name}_wall_s"] = into.get(f"{name}_wall_s", 0.0) + time.perf_counter() - t0

    setattr(owner, attr, timed)


def time_waits() -> dict[str, float]:
    """Wall seconds the worker's threads wait on each other (filled in as the shards run): the main
    thread for the helper's next slice, the helper for the tokenizer thread. Empty for code without
    the helper (batchinfer.engine.ahead)."""
    waits: dict[str, float] = {}
    try:
        from batchinfer.engine.ahead import Ahead
    except ImportError:
        return waits
    take, hand_over = Ahead._take, Ahead._hand_over

    def timed_take(self: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return take(self)
        finally:
            waits["main_for_helper_s"] = waits.get("main_for_helper_s", 0.0) + time.perf_counter() - t0

    def timed_hand_over(self: Any, pending: Any) -> bool:
        if pending is not None:  # the tokenizer thread's job: waited for here, then finished as before
            t0 = time.perf_counter()
            pending[1].result()
            waits["helper_for_tokenizer_s"] = waits.get("helper_for_tokenizer_s", 0.0) + time.perf_counter() - t0
        return hand_over(self, pending)

    Ahead._take, Ahead._hand_over = timed_take, timed_hand_over  # type: ignore[method-assign]
    return waits


def child_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One measurement of the worker (this process, pinned): see the module docstring."""
    import shutil

    sys.path.insert(0, str(Path(spec["code"]) / "tests"))
    from support.standin import StandinEngine

    import batchinfer
    from batchinfer.config.compose import compose
    from batchinfer.engine.worker import ShardWorker
    from batchinfer.launch.local import run_shards
    from batchinfer.rundir.merge import merge
    from batchinfer.rundir.prepare import prepare
    from batchinfer.rundir.shard_folder import ShardFolder

    try:
        from batchinfer.engine.phases import CLOCK
    except ImportError:  # a checkout from before the phase clock
        CLOCK = None
    waits = time_waits()

    out = Path(spec["dir"]) / f"run-{spec['name']}"
    shutil.rmtree(out, ignore_errors=True)
    overrides = [
        f"input.path={spec['corpus']}",
        "input.id_column=id",
        f"output.dir={out}",
        f"model.path={spec['model']}",
        f"sampling.max_tokens={MAX_TOKENS}",
        "model.max_model_len=2048",
        f"model.max_num_seqs={MAX_NUM_SEQS}",
    ]
    cfg = compose(overrides)
    timings: dict[str, float] = {}
    c0, t0 = time.process_time(), time.perf_counter()
    run = prepare(cfg)
    timings.update(prepare_cpu_s=time.process_time() - c0, prepare_wall_s=time.perf_counter() - t0)
    wrap_cpu(ShardWorker, "commit", timings, "commit")
    wrap_cpu(ShardFolder, "finish", timings, "compaction")
    step = spec["step_s"]
    engine = TimedEngine(StandinEngine(run.config, step_seconds=step), 2 * MAX_NUM_SEQS)
    engine.encode([{"role": "user", "content": "warm up"}])
    if CLOCK is not None:
        CLOCK.enable()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here: the shards' peak
    rss0 = _status("VmRSS")
    c0, t0 = time.process_time(), time.perf_counter()
    run_shards(run, [s.index for s in run.shards()], engine=engine)
    shard_cpu, shard_wall = time.process_time() - c0, time.perf_counter() - t0
    hwm = _status("VmHWM")
    phases = CLOCK.figures() if CLOCK is not None else {}
    c0, t0 = time.process_time(), time.perf_counter()
    stats = merge(run)
    timings.update(merge_cpu_s=time.process_time() - c0, merge_wall_s=time.perf_counter() - t0)
    import pyarrow.parquet as pq

    table = pq.read_table(run.output_path)
    digest = hashlib.sha256(repr(table.to_pydict()).encode()).hexdigest()[:16]
    rows = spec["rows"]
    return {
        **{k: spec[k] for k in ("name", "code_label", "prompts", "dup", "run", "engine", "cores", "pool", "rows")},
        "step_s": step,
        "code": str(Path(batchinfer.__file__).parent.parent),
        "shards_wall_s": shard_wall,
        "rows_s": rows / shard_wall,
        "process_cpu_s": shard_cpu,
        "engine_own_cpu_s": sum(engine.own_cpu.values()),
        "engine_own_by_call_s": engine.own_cpu,
        "worker_cpu_s": shard_cpu - sum(engine.own_cpu.values()),
        "worker_us_row": (shard_cpu - sum(engine.own_cpu.values())) / rows * 1e6,
        **timings,
        "phases": phases,
        "engine_idle": engine.idle(),
        "waits_s": waits,
        "rss_start_mb": rss0 / 1024,
        "rss_peak_mb": hwm / 1024,
        "output_digest": digest,
        "prompt_tokens": stats.get("prompt_tokens"),
    }


def child_plain(spec: dict[str, Any]) -> dict[str, Any]:
    """The same rows through a plain script's preprocessing (this process, pinned)."""
    from transformers import AutoTokenizer

    texts = [json.loads(line)["text"] for line in Path(spec["corpus"]).read_text().splitlines()]
    chats = [[{"role": "user", "content": t}] for t in texts]
    tok = AutoTokenizer.from_pretrained(spec["model"])
    tok.apply_chat_template(chats[0], tokenize=False, add_generation_prompt=True)  # compile the template
    out: dict[str, Any] = {k: spec[k] for k in ("name", "prompts", "dup", "cores", "pool", "rows")}
    out["kind"] = "plain"

    few = spec.get("plain_rows") or len(chats)  # the slower references over the first rows only
    out["plain_rows"] = min(few, len(chats))

    def timed(label: str, f: Any, n: int) -> Any:
        c0, t0 = time.process_time(), time.perf_counter()
        result = f()
        out[f"{label}_us_row"] = (time.process_time() - c0) / n * 1e6
        out[f"{label}_rows_s"] = n / (time.perf_counter() - t0)
        return result

    def one_by_one() -> list[list[int]]:
        return [
            tok.encode(tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
            for c in chats[:few]
        ]

    def batch_call() -> list[list[int]]:
        rendered = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
        return tok(rendered, add_special_tokens=False)["input_ids"]

    batch = timed("batch_call", batch_call, len(chats))
    ids = timed("one_by_one", one_by_one, out["plain_rows"])
    out["same_ids"] = ids == batch[:few]
    out["prompt_tokens"] = sum(map(len, batch))
    try:
        from vllm.engine.arg_utils import EngineArgs
        from vllm.renderers import ChatParams, merge_kwargs, renderer_from_config
    except ImportError as e:
        out["vllm_error"] = f"{type(e).__name__}: {e}"
        return out
    config = EngineArgs(model=spec["model"], max_model_len=2048, enforce_eager=True).create_engine_config()
    renderer = renderer_from_config(config)
    params = ChatParams(
        chat_template=None,
        chat_template_content_format="auto",
        chat_template_kwargs=merge_kwargs(
            None, dict(add_generation_prompt=True, continue_final_message=False, tools=None, tokenize=False)
        ),
    )
    tok_params = renderer.default_chat_tok_params.with_kwargs(add_special_tokens=False)
    renderer.render_chat(chats[:2], params, tok_params)  # content format detected, template compiled
    _, inputs = timed("vllm_chat", lambda: renderer.render_chat(chats[:few], params, tok_params), out["plain_rows"])
    out["vllm_same_ids"] = [list(i["prompt_token_ids"]) for i in inputs] == ids
    return out


def child(spec: dict[str, Any]) -> None:
    """Pin, set the tokenizer's pool, measure, print one JSON line."""
    allowed = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, allowed[: spec["cores"]])
    load = os.getloadavg()[0]
    result = child_plain(spec) if spec.get("kind") == "plain" else child_worker(spec)
    result["affinity"] = sorted(os.sched_getaffinity(0))
    result["load_1min"] = [load, os.getloadavg()[0]]  # the machine's load average before and after
    print("RESULT " + json.dumps(result), flush=True)


# ----------------------------------------------------------------------------- the parent


def spawn(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one measurement in a child process (the checkout in spec['code'] first on its path)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([spec["code"], str(ROOT / "benchmarks")]))
    env.pop("TOKENIZERS_PARALLELISM", None)
    if not spec["pool"]:
        env["TOKENIZERS_PARALLELISM"] = "false"
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    cmd = [sys.executable, __file__, "--child", json.dumps(spec)]
    res = subprocess.run(cmd, cwd=spec["code"], env=env, capture_output=True, text=True)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
    if res.returncode != 0 or not lines:
        raise SystemExit(f"{spec['name']} failed ({res.returncode}):\n{res.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def step_seconds(rate: float) -> float:
    """The stand-in's step time at which it finishes `rate` rows/s with its queue full: it
    finishes about a third of the 2 x max_num_seqs requests in flight per step."""
    return (2 * MAX_NUM_SEQS / 3) / rate


def model_folder() -> str:
    """SmolLM2-135M-Instruct's folder (its tokenizer and chat template are what is measured)."""
    from _common import model_folder as folder

    return str(folder())


def per_row(r: dict[str, Any], key: str) -> Optional[float]:
    """A CPU-seconds figure of a run as microseconds per row."""
    v = r.get(key)
    return None if v is None else v / r["rows"] * 1e6


def phase_rows(r: dict[str, Any]) -> dict[str, float]:
    """µs of CPU per row by phase: the code's own phases, commit, compaction and the rest."""
    out = {p: r["phases"][p]["cpu_s"] / r["rows"] * 1e6 for p in PHASE_ORDER if p in r["phases"]}
    if "submit" in out:  # the stand-in's own add is inside the worker's submit phase
        out["submit"] -= r["engine_own_by_call_s"].get("add", 0.0) / r["rows"] * 1e6
    for k in ("commit", "compaction"):
        out[k] = per_row(r, f"{k}_cpu_s") or 0.0
    out["other"] = r["worker_us_row"] - sum(out.values())
    out["merge"] = per_row(r, "merge_cpu_s") or 0.0
    return out


def core_bound(r: dict[str, Any]) -> Optional[float]:
    """The most two cores can give by a one-core run's phases: the tokenizer's batch call releases
    the GIL, everything else holds it (Amdahl: wall >= max(the GIL's share, the CPU over 2 cores))."""
    if not r["phases"] or "tokenize" not in r["phases"]:
        return None
    total = r["worker_us_row"]
    gil = total - r["phases"]["tokenize"]["cpu_s"] / r["rows"] * 1e6
    return total / max(gil, total / 2)


def summary(
    results: list[dict[str, Any]], plains: dict[tuple[str, float, int], dict[str, Any]], label: str
) -> list[str]:
    """The headline table: each target beside its figure, and the load average next to each."""
    by = {(r["prompts"], r["dup"], r["run"]): r for r in results if r["code_label"] == label}
    md = [
        "| prompts | dup | worker CPU µs/row (1 core) | bare render + batch tokenize µs/row | worker / bare "
        f"(target ≤ {TARGET_CPU}x) | rows/s 1 core | rows/s 2 cores | 2 cores / 1 core (target ≥ {TARGET_CORES}x) | "
        "two-core bound from the phases | engine idle between steps at the GPU rate | peak RSS MB | load (1 core / 2 cores / GPU rate) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (prompts, dup, run), r1 in by.items():
        if run != "cpu1":
            continue
        r2, g = by.get((prompts, dup, "cpu2")), by.get((prompts, dup, "gpu2"))
        bare = plains.get((prompts, dup, 1), {}).get("batch_call_us_row")
        ratio = f"**{r1['worker_us_row'] / bare:.2f}x**" if bare else ""
        two = f"**{r2['rows_s'] / r1['rows_s']:.2f}x**" if r2 else ""
        rows2 = f"{r2['rows_s']:,.0f}" if r2 else ""
        bound = core_bound(r1)
        idle = ""
        if g:
            busy = g["engine_idle"]["busy_s"] / g["shards_wall_s"]
            idle = f"{g['engine_idle']['idle_share']:.1%} (busy {busy:.0%} of the wall, {g['rows_s']:,.0f} rows/s)"
        peak = max(x["rss_peak_mb"] for x in (r1, r2, g) if x)
        loads = " / ".join(_load(x) if x else "-" for x in (r1, r2, g))
        md.append(
            f"| {prompts} | {dup:.0%} | {r1['worker_us_row']:.0f} | {f'{bare:.0f}' if bare else ''} | {ratio} | "
            f"{r1['rows_s']:,.0f} | {rows2} | {two} | "
            f"{f'{bound:.2f}x' if bound else ''} | {idle} | {peak:.0f} | {loads} |"
        )
    md.append("")
    return md


def table(results: list[dict[str, Any]], plains: dict[tuple[str, float, int], dict[str, Any]]) -> list[str]:
    """The results page's tables."""
    md = []
    md.append("### The worker's CPU per row, one core (`cpu1`), against a plain script's preprocessing")
    md.append("")
    md.append(
        "| prompts | dup | code | task rows/s | worker µs/row | plain: one by one µs/row | ratio | "
        "bare: render + batch call µs/row | ratio | vLLM `LLM.chat` preprocessing µs/row | ratio | peak RSS MB | "
        "output | load | load, plain |"
    )
    md.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if r["run"] != "cpu1":
            continue
        p = plains.get((r["prompts"], r["dup"], 1), {})
        plain = " | ".join(
            f"{p[k]:.0f} | {r['worker_us_row'] / p[k]:.2f}x" if p.get(k) else " | "
            for k in ("one_by_one_us_row", "batch_call_us_row", "vllm_chat_us_row")
        )
        md.append(
            f"| {r['prompts']} | {r['dup']:.0%} | {r['code_label']} | {r['rows_s']:,.0f} | {r['worker_us_row']:.0f} | "
            f"{plain} | {r['rss_peak_mb']:.0f} | `{r['output_digest']}` | {_load(r)} | {_load(p) if p else ''} |"
        )
    few = {p.get("plain_rows") for p in plains.values()}
    md.append("")
    md.append(
        f"Bare: every row's chat rendered with `apply_chat_template`, then one tokenizer batch call, one core; "
        f"one by one and vLLM's `LLM.chat` preprocessing over the first {', '.join(map(str, sorted(few)))} rows. "
        "The output digest is the merged output's: the same in every run of the same rows."
    )
    md.append("")
    phased = [r for run in ("cpu1", "gpu2") for r in results if r["run"] == run and r["phases"]]
    if phased:
        cols = [*PHASE_ORDER, "commit", "compaction", "other", "merge"]
        md.append(
            "### CPU µs per row by phase: no engine time, one core (`cpu1`), and the simulated GPU rate, "
            "two cores (`gpu2`)"
        )
        md.append("")
        md.append("| run | prompts | dup | code | " + " | ".join(cols) + " | worker total | load |")
        md.append("|---|---|---|---|" + "---|" * (len(cols) + 2))
        for r in phased:
            ph = phase_rows(r)
            cells = " | ".join(f"{ph.get(c, 0.0):.1f}" for c in cols)
            md.append(
                f"| {r['run']} | {r['prompts']} | {r['dup']:.0%} | {r['code_label']} | {cells} | "
                f"{r['worker_us_row']:.0f} | {_load(r)} |"
            )
        md.append("")
        md.append(
            "`submit` without the stand-in's own `add`; `other`: the worker's CPU in no timed phase (the main "
            "loop, progress records, reading committed parts at a shard's start; with two cores also the "
            "tokenizer's own pool threads, which no phase's thread clock sees, so `tokenize` looks smaller there); "
            "`merge` is the run's merge afterwards, not in the total."
        )
        md.append("")
    md.append("### Two cores: task rows/s against one core (`cpu2` / `cpu1`)")
    md.append("")
    md.append(
        "| prompts | dup | code | rows/s, 1 core | rows/s, 2 cores | 2 cores / 1 core | cores busy (CPU / wall), "
        "1 core / 2 cores | main thread waits for the helper s, 1 / 2 cores | helper waits for the tokenizer s, "
        "2 cores | plain bare rows/s, 1 core | load, 1 core | load, 2 cores |"
    )
    md.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
    by = {(r["prompts"], r["dup"], r["code_label"], r["run"]): r for r in results}
    for (prompts, dup, label, run), r1 in by.items():
        if run != "cpu1" or (prompts, dup, label, "cpu2") not in by:
            continue
        r2 = by[(prompts, dup, label, "cpu2")]
        p = plains.get((prompts, dup, 1), {})
        plain = f"{p['batch_call_rows_s']:,.0f}" if p.get("batch_call_rows_s") else ""
        busy = " / ".join(f"{r['process_cpu_s'] / r['shards_wall_s']:.2f}" for r in (r1, r2))
        waits = " / ".join(f"{r.get('waits_s', {}).get('main_for_helper_s', 0):.1f}" for r in (r1, r2))
        tok = f"{r2.get('waits_s', {}).get('helper_for_tokenizer_s', 0):.1f}"
        md.append(
            f"| {prompts} | {dup:.0%} | {label} | {r1['rows_s']:,.0f} | {r2['rows_s']:,.0f} | "
            f"{r2['rows_s'] / r1['rows_s']:.2f}x | {busy} | {waits} | {tok} | {plain} | {_load(r1)} | {_load(r2)} |"
        )
    md.append("")
    gpu = [r for r in results if r["run"] == "gpu2"]
    if gpu:
        md.append("### At the simulated GPU rate (`gpu2`, two cores): does the engine wait for the worker?")
        md.append("")
        md.append(
            "| prompts | dup | code | task rows/s | engine steps | engine idle between steps s | idle share | "
            "of which commits s | of which compaction s | longest gap s | steps short of requests | load |"
        )
        md.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in gpu:
            e = r["engine_idle"]
            md.append(
                f"| {r['prompts']} | {r['dup']:.0%} | {r['code_label']} | {r['rows_s']:,.0f} | {e['steps']} | "
                f"{e['idle_s']:.2f} | {e['idle_share']:.1%} | {r.get('commit_wall_s', 0):.2f} | "
                f"{r.get('compaction_wall_s', 0):.2f} | {e['idle_max_s']:.3f} | {e['steps_short']} | {_load(r)} |"
            )
        md.append("")
    return md


def _load(r: dict[str, Any]) -> str:
    """The 1-minute load average before and after a run (2 cores: above ~2, others were running)."""
    before, after = r.get("load_1min", [None, None])
    return f"{before:.1f}-{after:.1f}" if before is not None else ""


def chart(results: list[dict[str, Any]], plains: dict[tuple[str, float, int], dict[str, Any]], path: Path) -> None:
    """CPU µs per row on one core: the worker (stacked by phase where timed) beside plain preprocessing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    one = [r for r in results if r["run"] == "cpu1"]
    if not one:
        return
    fig, ax = plt.subplots(figsize=(max(7, 1.3 * len(one) + 3), 4.6))
    cols = [*PHASE_ORDER, "commit", "compaction", "other"]
    colors = plt.get_cmap("tab20")(range(len(cols)))
    labels = []
    for x, r in enumerate(one):
        labels.append(f"{r['prompts']}\n{r['dup']:.0%} dup\n{r['code_label']}")
        if r["phases"]:
            bottom = 0.0
            ph = phase_rows(r)
            for i, c in enumerate(cols):
                v = max(ph.get(c, 0.0), 0.0)
                ax.bar(x, v, 0.6, bottom=bottom, color=colors[i], label=c if x == len(one) - 1 else None)
                bottom += v
        else:
            ax.bar(x, r["worker_us_row"], 0.6, color="0.6", label="worker (not by phase)" if x == 0 else None)
        p = plains.get((r["prompts"], r["dup"], 1), {})
        for key, style, name in (
            ("one_by_one_us_row", "k_", "plain: render + tokenize, one by one"),
            ("batch_call_us_row", "r_", "bare: render + tokenizer batch call"),
            ("vllm_chat_us_row", "b_", "plain: vLLM LLM.chat preprocessing"),
        ):
            if p.get(key):
                ax.plot([x], [p[key]], style, ms=30, mew=2, label=name if x == 0 else None)
        if p.get("batch_call_us_row"):
            target = TARGET_CPU * p["batch_call_us_row"]
            ax.plot(
                [x - 0.3, x + 0.3],
                [target, target],
                "r--",
                lw=1,
                label=f"target: {TARGET_CPU}x render + batch call" if x == 0 else None,
            )
    ax.set_xticks(range(len(one)), labels, fontsize=8)
    ax.set_ylabel("CPU µs per row, one core")
    ax.legend(fontsize=7, ncol=2)
    load = ", ".join(_load(r) for r in one)
    fig.suptitle(
        f"The worker's own CPU per row against plain preprocessing ({one[0]['rows']:,} rows, SmolLM2)\n"
        f"{machine_line()}; load average per bar: {load}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def machine_line() -> str:
    """The CPU, its bf16 flags and the cores, for a figure's caption."""
    from _common import machine

    m = machine()
    return f"{m['cpu']}, {m['cores']} cores, bf16: {', '.join(k for k, v in m['flags'].items() if 'bf16' in k and v) or 'none'}"


def kills(a: argparse.Namespace) -> dict[str, Any]:
    """Work lost to a SIGKILL at the simulated rate (commit_bench.work_lost), two cores, the load beside it."""
    from commit_bench import work_lost

    before = os.getloadavg()[0]
    # A kill falls up to ~17 s into the run (first commit, then 1-12 s): enough rows to be running then.
    rows = max(a.rows, KILL_ROWS)
    try:
        r = work_lost(a.gpu_rate, a.kills, rows, MAX_NUM_SEQS)
    except SystemExit as e:  # the run ended before a kill: said in the results, the rest kept
        return {"error": str(e), "rows": rows, "load_1min": [before, os.getloadavg()[0]]}
    r["rows"] = rows
    r["load_1min"] = [before, os.getloadavg()[0]]
    print(json.dumps({k: v for k, v in r.items() if k != "kills"}), flush=True)
    return r


def lost_md(r: dict[str, Any]) -> list[str]:
    """The kill table."""
    from commit_bench import lost_table

    if "error" in r:
        return ["### Work lost to a SIGKILL at the simulated GPU rate", "", f"Not measured: {r['error']}", ""]
    return [
        f"### Work lost to a SIGKILL at the simulated GPU rate ({r['rate']:,.0f} rows/s)",
        "",
        f"`batchinfer run` over {r['rows']:,} short rows on the stand-in engine (the tests' tiny model's tokenizer, {r['step_seconds']:.4f} s "
        f"steps, {r['rows_per_step']:.0f} rows a step), default commit policy, killed {len(r['kills'])} times "
        f"at a random moment after its first commit; load {_load(r)}.",
        "",
        lost_table({"default": r}),
        "",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=20_000, help="rows per configuration (the issue's: 100000, 1000000)")
    ap.add_argument("--gpu-rate", type=float, default=2000.0, help="rows/s per GPU the stand-in finishes (gpu runs)")
    ap.add_argument("--prompts", nargs="+", default=["short", "long"], choices=["short", "long"])
    ap.add_argument("--dups", nargs="+", type=float, default=[0.0, 0.1])
    ap.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    ap.add_argument("--code", help="another checkout to measure the same way (e.g. a worktree of the commit before)")
    ap.add_argument("--code-label", default="before")
    ap.add_argument("--label", default="after", help="this checkout's label")
    ap.add_argument("--no-plain", action="store_true", help="skip the plain preprocessing baselines")
    ap.add_argument("--plain-rows", type=int, default=5000, help="rows for the slower plain references")
    ap.add_argument("--kills", type=int, default=2, help="SIGKILLs at the simulated rate (0: none)")
    ap.add_argument("--dir", type=Path, default=Path(os.environ.get("BENCH_DIR", "/tmp/ceiling-bench")))
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--append", action="store_true", help="keep --out's measurements of other configurations")
    ap.add_argument("--report-only", action="store_true", help="rewrite ceiling.md and .png from --out's ceiling.json")
    ap.add_argument("--child")
    a = ap.parse_args()
    if a.child:
        return child(json.loads(a.child))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    a.dir.mkdir(parents=True, exist_ok=True)
    model = model_folder()
    codes = [(a.label, str(ROOT))] + ([(a.code_label, str(Path(a.code).resolve()))] if a.code else [])
    results: list[dict[str, Any]] = []
    plain_list: list[dict[str, Any]] = []
    lost = None
    if (a.append or a.report_only) and (
        a.out / "ceiling.json"
    ).is_file():  # a run split in parts (the heavy lock's slots)
        kept = json.loads((a.out / "ceiling.json").read_text())
        results, plain_list, lost = kept["results"], kept["plain"], kept.get("lost")
        a.commands = kept.get("commands", [])
        a.machine = kept.get("machine")
    if not a.report_only:
        a.commands = [*getattr(a, "commands", []), " ".join(["python", "benchmarks/ceiling.py", *sys.argv[1:]])]

    def keep(item: dict[str, Any], into: list[dict[str, Any]]) -> None:
        """Add a measurement (replacing one of the same name) and write the results so far."""
        into[:] = [x for x in into if x["name"] != item["name"]] + [item]
        write(a, results, plain_list, lost)

    if a.report_only:
        write(a, results, plain_list, lost)
        chart(results, {(p["prompts"], p["dup"], p["cores"]): p for p in plain_list}, a.out / "ceiling.png")
        return
    for prompts in a.prompts:
        for dup in a.dups:
            path = corpus(a.dir / f"{prompts}-{dup:g}-{a.rows}.jsonl", a.rows, prompts, dup)
            base = {"corpus": str(path), "model": model, "dir": str(a.dir), "prompts": prompts, "dup": dup}
            base["rows"] = a.rows
            for run in a.runs:
                for label, code in codes:
                    spec = dict(base, **RUNS[run], run=run, code=code, code_label=label)
                    spec["step_s"] = step_seconds(a.gpu_rate) if spec["engine"] == "gpu" else 0.0
                    spec["name"] = f"{prompts}-{dup:g}-{run}-{label}"
                    r = spawn(spec)
                    keep(r, results)
                    print(json.dumps({k: v for k, v in r.items() if k != "phases"}), flush=True)
            if not a.no_plain:  # one core: the target is per row on one core
                spec = dict(base, kind="plain", cores=1, pool=False, code=str(ROOT), plain_rows=a.plain_rows)
                spec["name"] = f"{prompts}-{dup:g}-plain-1"
                p = spawn(spec)
                keep(p, plain_list)
                print(json.dumps(p), flush=True)
    if a.kills:
        lost = kills(a)
    write(a, results, plain_list, lost)
    chart(results, {(p["prompts"], p["dup"], p["cores"]): p for p in plain_list}, a.out / "ceiling.png")


def write(
    a: argparse.Namespace, results: list[dict[str, Any]], plain_list: list[dict[str, Any]], lost: Optional[dict]
) -> None:
    """ceiling.json and ceiling.md from the measurements so far."""
    from _common import machine

    plains = {(p["prompts"], p["dup"], p["cores"]): p for p in plain_list}
    report = {
        "machine": a.machine if a.report_only else machine(),
        "commands": a.commands,
        "gpu_rate": a.gpu_rate,
        "max_num_seqs": MAX_NUM_SEQS,
        "results": results,
        "plain": plain_list,
        "lost": lost,
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "ceiling.json").write_text(json.dumps(report, indent=1))
    m = report["machine"]
    head = [
        "# The pipeline's own ceiling (issue 44)",
        "",
        f"{m['cpu']}, {m['cores']} cores (flags: {', '.join(k for k, v in m['flags'].items() if v)}), "
        f"{m['date']}. " + " then ".join(f"`{c}`" for c in a.commands) + ", each under `flock /tmp/heavy.lock`."
        f" SmolLM2-135M-Instruct's tokenizer and chat template, "
        f"max_num_seqs {MAX_NUM_SEQS}, max_tokens {MAX_TOKENS}, GPU rate simulated {a.gpu_rate:,.0f} rows/s "
        f"(stand-in step {step_seconds(a.gpu_rate):.4f} s).",
        "",
    ]
    head += ["## Headline", ""] + summary(results, plains, a.label)
    head += [
        "Two-core bound: the one-core run's worker CPU over the larger of its GIL-holding part (all but the "
        "tokenizer's batch call) and half of it. Engine idle: the share of the shards' time between two engine "
        "steps at the simulated GPU rate, two cores (the GPU waiting for the worker); busy: its steps' share of the "
        "shards' wall time, start-up and each shard's start and end included. Load: the 1-minute load "
        "average before-after each run (2 cores: above 2, other work was running).",
        "",
        "## Details",
        "",
    ]
    md = head + table(results, plains)
    if lost is not None:
        md += lost_md(lost)
    (a.out / "ceiling.md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
