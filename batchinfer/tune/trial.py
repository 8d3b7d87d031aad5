"""One setting's trial, in its own process: `python -m batchinfer.tune.trial SPEC.json`.

It builds the engine once, says `ready` with the start-up seconds, then for each `go R` line on
stdin runs rung R of the pilot as a small run directory through the local runner with that engine
and answers one JSON line; `stop` (or end of input) closes the engine. A setting whose task runs
several engines (cluster.engines_per_task) has no engine to share: it says `ready` at once, and
each rung is a run directory of one shard per engine that the local runner gives to engine
processes started for it, as a task does; the rung's answer carries their start-up. A failure
is answered as `failed` with its reason. Protocol lines go to the original stdout; everything
else (vLLM, tqdm, `run`'s own lines) to stderr, which the parent keeps in the trial's log."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from batchinfer.tune.halving import Rung
from batchinfer.tune.stepclock import StepClock

log = logging.getLogger("batchinfer")

# Keys the trial sets for every rung itself: the user's values for them would clash.
TRIAL_KEYS = (
    "input.path",
    "input.format",
    "input.split",
    "output.dir",
    "output.reuse",
    "sharding.num_shards",
    "sharding.rows_per_shard",
)


def rung_overrides(overrides: list[str], rung_input: str, out: str, shards: int = 1) -> list[str]:
    """The user's and the setting's overrides, pointed at one rung's rows and run directory of
    `shards` shards (one per engine of the task)."""
    kept = [o for o in overrides if o.partition("=")[0].lstrip("+~") not in TRIAL_KEYS]
    return [
        *kept,
        f"input.path={rung_input}",
        "input.format=parquet",
        f"output.dir={out}",
        "output.reuse=null",  # reused answers would inflate the measured rate
        f"sharding.num_shards={shards}",
    ]


def first_rung_config(spec: dict[str, Any]) -> Any:
    """The setting's config as its first rung composes it (what its engine is built from)."""
    from batchinfer.config.compose import compose

    out = str(Path(spec["out"]) / "rung-0")
    return compose(rung_overrides(spec["overrides"], spec["rungs"][0], out), config_dir=spec["config_dir"])


class PeakMemory:
    """The largest resident memory of this process and its children (vLLM's engine core), sampled
    every half second while a rung runs."""

    def __init__(self) -> None:
        self.peak_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def sample(self) -> None:
        """Add one reading of the process tree's resident memory."""
        import psutil

        me = psutil.Process()
        try:
            rss = sum(p.memory_info().rss for p in [me, *me.children(recursive=True)])
        except psutil.Error:
            return
        self.peak_mb = max(self.peak_mb, rss / 2**20)

    def _watch(self) -> None:
        self.sample()
        while not self._stop.wait(0.5):
            self.sample()

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()  # a rung shorter than the interval still gets a reading


def measure(run: Any, index: int, peak: Optional[float], own_start: bool = False) -> Rung:
    """A finished rung's figures from its shards' DONE.json and committed rows. Engines of one task
    run side by side: the rung's generate seconds are their engine-seconds shared among them (its
    span when they share the work evenly), so its rate is the task's, also when the engine ready
    first took more than its share of a short rung; own_start: its engines started for it, the
    slowest start-up recorded by an engine that ran a shard is the rung's."""
    from batchinfer.rundir.progress import read_progress

    records = [read_progress(run.shard_folder(s.index).done_path) for s in run.shards()]
    done = [r for r in records if r is not None]
    names = [n for n in ("output_tokens", "finish_reason") if n in run.schema.names]
    rows: dict[str, list[Any]] = {n: [] for n in names}
    for shard in run.shards() if names else []:
        for n, values in run.shard_folder(shard.index).read_rows(columns=names).to_pydict().items():
            rows[n] += values
    engines = max([int((r.engine or {}).get("of", 1)) for r in done] or [1])
    caches = [r.prefix_cache for r in done if r.prefix_cache is not None]
    queries = sum(c.queries for c in caches)
    return Rung(
        rung=index,
        rows=sum(r.rows_done for r in done),
        prompt_tokens=sum(r.prompt_tokens for r in done),
        output_tokens=sum(r.output_tokens for r in done),
        generate_seconds=sum(r.seconds.generate for r in done) / engines,
        prefix_cache_hit_rate=round(sum(c.hits for c in caches) / queries, 4) if queries else None,
        peak_memory_mb=round(peak, 1) if peak else None,
        output_lengths=[int(n or 0) for n in rows.get("output_tokens", [])],
        stopped_at_max_tokens=sum(1 for r in rows.get("finish_reason", []) if r == "length"),
        engines=engines,
        startup_seconds=round(max(engine_startup(r) for r in done), 2) if own_start and done else None,
    )


def engine_startup(record: Any) -> float:
    """Seconds a shard's engine took to start: its engine record's (a task's engine starts before it
    takes a shard), else the shard's own start-up phase (an engine started for the shard)."""
    return float((record.engine or {}).get("startup_seconds") or record.seconds.startup)


def build_engine(cfg: Any) -> Any:
    """The setting's engine, built from its config as a run resolves it (model presets to folders)."""
    from batchinfer.config.schema import to_config
    from batchinfer.engine.factory import engine_class
    from batchinfer.rundir.prepare import resolve_input

    resolved, _ = resolve_input(cfg)
    return engine_class()(to_config(resolved))


def run_rung(spec: dict[str, Any], engine: Any, index: int, engines: int = 1) -> Rung:
    """Rung `index`: its rows as a one-shard run directory on the engine already built (its steps
    timed when it is a StepClock), or (engine None) as a run directory of one shard per engine, run
    as a task with that many engines runs it."""
    from batchinfer.config.compose import compose
    from batchinfer.launch.local import run_local

    out = str(Path(spec["out"]) / f"rung-{index}")
    overrides = rung_overrides(spec["overrides"], spec["rungs"][index], out, engines)
    cfg = compose(overrides, config_dir=spec["config_dir"])
    if isinstance(engine, StepClock):
        engine.reset()
    with PeakMemory() as mem:
        run = run_local(cfg, engine=engine)
    rung = measure(run, index, mem.peak_mb, own_start=engine is None)
    if isinstance(engine, StepClock):
        rung.steps = engine.stats(rung.generate_seconds * rung.engines)
        rung.limits = engine.limits()
    return rung


def _reason(e: BaseException) -> str:
    """The first line that says what went wrong (vLLM's refusals are long)."""
    text = [line.strip() for line in str(e).splitlines() if line.strip()]
    if len(text) > 1 and "validation error" in text[0]:  # pydantic: the reason is on the next line
        text = [f"{text[0]}: {text[1].split(' [type=')[0]}"]
    return f"{type(e).__name__}: {text[0] if text else ''}"[:400]


def serve(spec: dict[str, Any], answer: Any, lines: Any) -> None:
    """Build the engine (none for a task of several), answer `go R` lines with rungs until `stop`
    or end of input."""
    engine = None
    try:
        from batchinfer.config.schema import to_config
        from batchinfer.launch.local import task_engines

        cfg = first_rung_config(spec)
        engines = task_engines(to_config(cfg), n_shards=sys.maxsize)  # a rung has one shard per engine
        if engines > 1:
            log.info("tune trial: %d engines per task, started for each rung as a task starts them", engines)
            answer({"event": "ready", "startup_seconds": None})
        else:
            t0 = time.monotonic()
            engine = StepClock(build_engine(cfg))
            startup = round(getattr(engine, "startup_seconds", time.monotonic() - t0), 2)
            log.info("tune trial: engine ready in %.1f s", startup)
            answer({"event": "ready", "startup_seconds": startup})
        for line in lines:
            word, _, arg = line.strip().partition(" ")
            if word != "go":
                break
            answer({"event": "rung", **asdict(run_rung(spec, engine, int(arg), engines))})
    except BaseException as e:  # noqa: BLE001  (any failure is the setting's row, not a crash)
        answer({"event": "failed", "reason": _reason(e)})
        if not isinstance(e, Exception):
            raise
    finally:
        if engine is not None:
            engine.close()


def main(argv: list[str]) -> int:
    """Entry point: the spec file, protocol on the original stdout, everything else on stderr."""
    from batchinfer.logs import setup_logging

    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    setup_logging()
    spec = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    serve(spec, lambda msg: print(json.dumps(msg), file=proto, flush=True), sys.stdin)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
