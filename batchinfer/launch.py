"""Fan shards out: locally in this process, or as a Slurm array (submitit) plus a merge job."""

from __future__ import annotations

import logging
import signal
import sys
from typing import Any, Optional

from omegaconf import DictConfig

from batchinfer.errors import RunDirError
from batchinfer.merge import merge
from batchinfer.plan import prepare
from batchinfer.store import RunDir, read_json

log = logging.getLogger("batchinfer")


def progress_bar(total: int, initial: int, desc: str) -> Any:
    """tqdm on a terminal; plain lines about every 5 s in logs."""
    from tqdm import tqdm

    tty = sys.stderr.isatty()
    return tqdm(
        total=total,
        initial=initial,
        desc=desc,
        unit="row",
        mininterval=0.5 if tty else 5.0,
        ascii=not tty,
        dynamic_ncols=tty,
    )


class EngineHolder:
    """Builds the engine on first use (a finished run never imports vllm) and reuses it."""

    def __init__(self, c: dict[str, Any], stop: Any, engine: Any = None):
        self.c = c
        self.stop = stop
        self.engine = engine
        if engine is not None:
            from batchinfer.engine import model_key

            if engine.key != model_key(c):
                raise RunDirError("the engine passed in was built for another model config")

    def __call__(self) -> Any:
        if self.engine is None:
            from batchinfer.engine import Engine

            log.info("starting vLLM engine for %s", self.c["model"]["path"])
            # Block stop signals while the engine starts: its processes inherit the mask (a
            # group-wide USR2 cannot kill them) and a signal sent meanwhile stays pending.
            self.stop.block()
            try:
                self.engine = Engine(self.c)
            finally:
                self.stop.install()
            log.info("engine ready in %.1f s", self.engine.startup_seconds)
        return self.engine

    def close(self, owned: bool) -> None:
        """Stop the engine if this holder built it."""
        if owned and self.engine is not None:
            self.engine.close()


def run_shards(run: RunDir, indices: list[int], engine: Any = None) -> None:
    """Finish the given shards in this process with one engine; stop signals commit first."""
    from batchinfer.worker import ShardWorker, StopFlag

    shards = [s for s in run.shards() if s.index in set(indices) and not run.is_done(s.index)]
    if not shards:
        return
    stop = StopFlag()
    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)}
    holder = EngineHolder(run.run["config"], stop, engine)
    committed = sum(_rows_done(run, s.index) for s in shards)
    bar = progress_bar(sum(s.rows for s in shards), committed, desc=run.path.name)
    try:
        stop.install()
        worker = ShardWorker(run, holder, stop, bar)
        for shard in shards:
            worker.run_shard(shard)
    finally:
        bar.close()
        holder.close(owned=engine is None)
        for s, h in saved.items():
            signal.signal(s, h)


def _rows_done(run: RunDir, index: int) -> int:
    p = run.progress_path(index)
    return read_json(p).get("rows_done", 0) if p.is_file() else 0


def run_local(cfg: DictConfig, engine: Any = None) -> RunDir:
    """`batchinfer run`: every shard here with one engine, then merge."""
    run = prepare(cfg)
    todo = [s.index for s in run.shards() if not run.is_done(s.index)]
    if not todo and run.output_path.is_file() and run.stats_json.is_file():
        rows = read_json(run.stats_json)["rows"]
        print(f"{run.path} is already complete: {rows} rows in {run.output_path}; nothing to do")
        return run
    if todo:
        run_shards(run, todo, engine)
    merge(run)
    print(f"done: {run.output_path}")
    return run


def shards_of_task(run: RunDir, task: int) -> list[int]:
    """Shards an array task runs: shards_per_task consecutive shards."""
    per = run.run["config"]["cluster"]["shards_per_task"]
    indices = [s.index for s in run.shards()][task * per : (task + 1) * per]
    if not indices:
        raise RunDirError(
            f"{run.path}: task {task} has no shards (the plan has {len(run.shards())} shards, {per} per task)"
        )
    return indices


def run_task(run_dir: str, task: int, engine: Optional[Any] = None) -> None:
    """`batchinfer worker DIR TASK`: the shards of one array task."""
    run = RunDir(run_dir)
    run_shards(run, shards_of_task(run, task), engine)
