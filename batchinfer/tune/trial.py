"""One setting's trial, in its own process: `python -m batchinfer.tune.trial SPEC.json`.

It builds the engine once, says `ready` with the start-up seconds, then for each `go R` line on
stdin runs rung R of the pilot as a small run directory through the local runner with that engine
and answers one JSON line; `stop` (or end of input) closes the engine. A failure is answered as
`failed` with its reason. Protocol lines go to the original stdout; everything else (vLLM, tqdm,
`run`'s own lines) to stderr, which the parent keeps in the trial's log."""

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

log = logging.getLogger("batchinfer")

# Keys the trial sets for every rung itself: the user's values for them would clash.
TRIAL_KEYS = (
    "input.path",
    "input.format",
    "input.split",
    "output.dir",
    "sharding.num_shards",
    "sharding.rows_per_shard",
)


def rung_overrides(overrides: list[str], rung_input: str, out: str) -> list[str]:
    """The user's and the setting's overrides, pointed at one rung's rows and run directory."""
    kept = [o for o in overrides if o.partition("=")[0].lstrip("+~") not in TRIAL_KEYS]
    return [*kept, f"input.path={rung_input}", "input.format=parquet", f"output.dir={out}", "sharding.num_shards=1"]


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


def measure(run: Any, index: int, peak: Optional[float]) -> Rung:
    """A finished rung's figures from its DONE.json and committed rows."""
    from batchinfer.rundir.durable import read_json
    from batchinfer.rundir.stats import with_rates

    done = with_rates(read_json(run.shard_folder(0).done_path))
    names = [n for n in ("output_tokens", "finish_reason") if n in run.schema.names]
    rows = run.shard_folder(0).read_rows(columns=names).to_pydict() if names else {}
    lengths = [int(n or 0) for n in rows.get("output_tokens", [])]
    return Rung(
        rung=index,
        rows=int(done.get("rows_done", 0)),
        prompt_tokens=int(done.get("prompt_tokens", 0)),
        output_tokens=int(done.get("output_tokens", 0)),
        generate_seconds=float(done.get("seconds", {}).get("generate", 0.0)),
        prefix_cache_hit_rate=done.get("prefix_cache_hit_rate"),
        peak_memory_mb=round(peak, 1) if peak else None,
        output_lengths=lengths,
        stopped_at_max_tokens=sum(1 for r in rows.get("finish_reason", []) if r == "length"),
    )


def build_engine(overrides: list[str], config_dir: Optional[str], rung_input: str, out: str) -> Any:
    """The setting's engine, built from its config as a run resolves it (model presets to folders)."""
    from batchinfer.config.compose import compose
    from batchinfer.config.schema import to_config
    from batchinfer.engine.factory import engine_class
    from batchinfer.rundir.prepare import resolve_input

    cfg = compose(rung_overrides(overrides, rung_input, out), config_dir=config_dir)
    resolved, _ = resolve_input(cfg)
    return engine_class()(to_config(resolved))


def run_rung(spec: dict[str, Any], engine: Any, index: int) -> Rung:
    """Rung `index`: its rows as a one-shard run directory, on the engine already built."""
    from batchinfer.config.compose import compose
    from batchinfer.launch.local import run_local

    out = str(Path(spec["out"]) / f"rung-{index}")
    cfg = compose(rung_overrides(spec["overrides"], spec["rungs"][index], out), config_dir=spec["config_dir"])
    with PeakMemory() as mem:
        run = run_local(cfg, engine=engine)
    return measure(run, index, mem.peak_mb)


def _reason(e: BaseException) -> str:
    """The first line that says what went wrong (vLLM's refusals are long)."""
    text = [line.strip() for line in str(e).splitlines() if line.strip()]
    if len(text) > 1 and "validation error" in text[0]:  # pydantic: the reason is on the next line
        text = [f"{text[0]}: {text[1].split(' [type=')[0]}"]
    return f"{type(e).__name__}: {text[0] if text else ''}"[:400]


def serve(spec: dict[str, Any], answer: Any, lines: Any) -> None:
    """Build the engine, answer `go R` lines with rungs until `stop` or end of input."""
    engine = None
    try:
        t0 = time.monotonic()
        engine = build_engine(
            spec["overrides"], spec["config_dir"], spec["rungs"][0], str(Path(spec["out"]) / "rung-0")
        )
        startup = round(getattr(engine, "startup_seconds", time.monotonic() - t0), 2)
        log.info("tune trial: engine ready in %.1f s", startup)
        answer({"event": "ready", "startup_seconds": startup})
        for line in lines:
            word, _, arg = line.strip().partition(" ")
            if word != "go":
                break
            answer({"event": "rung", **asdict(run_rung(spec, engine, int(arg)))})
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
