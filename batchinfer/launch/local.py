"""Run shards here: one engine reused across shards, for `run`, `worker` and a Slurm array task."""

from __future__ import annotations

import logging
import signal
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from omegaconf import DictConfig

from batchinfer import faults, security
from batchinfer.config.engines import engine_devices, engines_per_task, task_gpus
from batchinfer.config.schema import Config
from batchinfer.engine.dtype import settle
from batchinfer.engine.output import EngineOutput
from batchinfer.errors import (
    BatchinferError,
    EngineFailure,
    RunDirError,
    SlurmUnavailable,
    TransientRunDirError,
)
from batchinfer.inputs.read import Shard
from batchinfer.launch import slurm
from batchinfer.rundir.merge import merge
from batchinfer.rundir.prepare import prepare
from batchinfer.rundir.store import RunDir, read_json, refused_write, storage_error
from batchinfer.stopsignals import STOP_SIGNALS

if TYPE_CHECKING:
    from batchinfer.launch.member import Member

log = logging.getLogger("batchinfer")


def progress_bar(total: int, initial: int, desc: str, file: Any = None) -> Any:
    """tqdm on a terminal; plain lines about every 5 s in logs."""
    from tqdm import tqdm

    file = file or sys.stderr
    tty = file.isatty()
    return tqdm(
        file=file,
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

    def __init__(self, c: Config, stop: Any, engine: Any = None, run_path: Optional[Path] = None):
        self.c = c
        self.stop = stop
        self.engine = engine
        # `model.dtype: auto` settled for the whole run in DIR/dtype.json (None: for this machine)
        self.dtype = settle(run_path, c.model.dtype) if run_path is not None else None
        if engine is not None:
            from batchinfer.engine.vllm_engine import model_key

            if engine.key != model_key(c):
                raise RunDirError("the engine passed in was built for another model config")
            if self.dtype not in (None, "auto", getattr(engine, "dtype", self.dtype)):
                raise RunDirError(f"the engine passed in runs {engine.dtype}; this run's shards use {self.dtype}")

    def __call__(self) -> Any:
        if self.engine is None:
            engine_cls = faults.engine_class()  # vLLM's (a test may name a stand-in)

            log.info("starting vLLM engine for %s", self.c.model.path)
            # Block stop signals while the engine starts: its processes inherit the mask (a
            # group-wide USR2 cannot kill them) and a signal sent meanwhile stays pending.
            self.stop.block()
            try:
                self.engine = engine_cls(self.c, self.dtype)
            finally:
                self.stop.install()
            log.info("engine ready in %.1f s", self.engine.startup_seconds)
        return self.engine

    def close(self, owned: bool) -> None:
        """Stop the engine if this holder built it."""
        if owned and self.engine is not None:
            self.engine.close()


def run_shards(run: RunDir, indices: list[int], engine: Any = None) -> None:
    """Finish the given shards in this process with one engine, or with cluster.engines_per_task
    engine processes; stop signals commit first."""
    shards = [s for s in run.shards() if s.index in set(indices) and not run.is_done(s.index)]
    if not shards:
        return
    n = 1 if engine is not None else task_engines(run.config, len(shards))
    with security.private_umask(run.config.output.private):
        if n > 1:
            from batchinfer.launch.engines import run_engines

            run_engines(run, shards, n)
            return
        with EngineOutput(run.logs_dir, enabled=engine is None) as output:
            _run_shards(run, shards, engine, output)


def task_engines(cfg: Config, n_shards: int) -> int:
    """Engines this task starts: cluster.engines_per_task for the GPUs it has, at most one per shard."""
    return min(engines_per_task(cfg, len(task_gpus(cfg))), n_shards)


def _run_shards(
    run: RunDir, shards: Iterable[Shard], engine: Any, output: EngineOutput, member: Optional[Member] = None
) -> None:
    """Run shards on one engine. Alone, this process decides what a failure or stop means for the
    task (requeue or not); as a `member` engine of a task, it raises and the task decides."""
    from batchinfer.engine.worker import CRASHES_TO_ISOLATE, ShardWorker, StopFlag, Stopped

    stop = StopFlag()
    saved = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    holder = EngineHolder(run.config, stop, engine, run.path)
    known = isinstance(shards, list)  # a member learns its shards one at a time
    total = sum(s.rows for s in shards) if known else 0
    committed = sum(_rows_done(run, s.index) for s in shards) if known else 0
    desc = run.path.name if member is None else f"{run.path.name} engine {member.index}"
    bar = progress_bar(total, committed, desc=desc, file=output.bar_file())
    current: Optional[Shard] = None
    worker = ShardWorker(run, holder, stop, bar)
    worker.engine = member.record if member is not None else solo_engine(run.config)
    try:
        stop.install()
        if member is not None:
            holder()  # a member's engine starts before it takes a shard: no shard lock is held meanwhile
        for current in shards:
            if not known:
                bar.total += current.rows
                bar.update(_rows_done(run, current.index))
            run_shard_retrying(worker, current, stop)
    except Stopped as e:
        if member is None:
            _stopped(e.signum)
        raise
    except BatchinferError:
        raise  # the input or config is wrong: another attempt would fail the same way
    except Exception as e:
        if isinstance(e, OSError) and refused_write(e) is not None:
            raise storage_error(Path(e.filename or run.path), e) from None
        if stop.signum is not None:  # the signal reached the engine too: a stop, not a failure
            if member is None:
                _stopped(stop.signum)
            raise Stopped(stop.signum) from e
        if member is not None:
            member.failed(current, worker.failures)
            raise
        index = current.index if current is not None else -1
        if slurm.this_job():
            # The worker counted the failure under the shard lock, against this submission's budget.
            if requeue_after_failure(run, index, worker.failures, e):
                slurm.requeue_self()
            raise
        log.exception("shard %d failed", index)
        raise EngineFailure(
            f"shard {index} failed: {type(e).__name__}: {e} (traceback above). Committed rows are "
            f"safe: run the same command again to finish. Rows that were in flight run one at a time "
            f"first, and a row in flight at {CRASHES_TO_ISOLATE} engine deaths becomes an error row"
        ) from None
    finally:
        bar.close()
        holder.close(owned=engine is None)
        for s, h in saved.items():
            signal.signal(s, h)


# A shard lock refused because Slurm did not answer about its holder is tried again after these
# waits (seconds); the last refusal is raised as any other.
LOCK_RETRY_WAITS = (10.0, 30.0, 60.0)


def transient_refusal(e: BaseException) -> bool:
    """Whether a shard lock refusal may go away by itself: Slurm did not answer about the holder."""
    return isinstance(e, (SlurmUnavailable, TransientRunDirError))


def run_shard_retrying(worker: Any, shard: Shard, stop: Any) -> None:
    """worker.run_shard, trying again while its lock is refused only because Slurm did not answer;
    a stop signal during a wait stops."""
    from batchinfer.engine.worker import Stopped

    for wait in (*LOCK_RETRY_WAITS, None):
        try:
            worker.run_shard(shard)
            return
        except BatchinferError as e:
            if wait is None or not transient_refusal(e) or stop.signum is not None:
                raise
            log.warning("shard %d: %s; trying again in %g s", shard.index, e, wait)
        deadline = time.monotonic() + wait
        while stop.signum is None and time.monotonic() < deadline:
            time.sleep(min(0.5, wait))
        if stop.signum is not None:
            raise Stopped(stop.signum)


def solo_engine(cfg: Config) -> Optional[dict[str, Any]]:
    """The engine record of a task that runs one engine where cluster.engines_per_task asks for more
    (fewer shards left than engines): report then counts all the task's GPUs for its shards."""
    if cfg.cluster.engines_per_task == 1:
        return None
    return {"index": 0, "of": 1, "devices": engine_devices()}


def requeue_after_failure(run: RunDir, index: int, failures: Optional[int], error: Any, who: str = "") -> bool:
    """Whether a failed shard earns the task another attempt (cluster.max_attempts per submission)."""
    limit = run.config.cluster.max_attempts
    if failures is None:
        log.error("%sshard %d failed outside its shard lock (%s): not requeueing", who, index, error)
        return False
    if failures < limit:
        log.error("%sshard %d failed (%s), attempt %d of %d: requeueing", who, index, error, failures, limit)
        return True
    log.error("%sshard %d failed %d times in this submission (cluster.max_attempts): giving up", who, index, failures)
    return False


def _stopped(signum: int) -> None:
    """USR2 under Slurm (time limit, preemption): requeue this task; TERM (scancel): just stop.

    Rows are committed by now. A requeue that fails raises RequeueFailed, so the task ends FAILED
    with the reason instead of COMPLETED with its shards unfinished."""
    if signum == signal.SIGUSR2 and slurm.this_job():
        slurm.requeue_this_job()


def _rows_done(run: RunDir, index: int) -> int:
    p = run.progress_path(index)
    return read_json(p).get("rows_done", 0) if p.is_file() else 0


def run_local(cfg: DictConfig, engine: Any = None) -> RunDir:
    """`batchinfer run`: every shard here with one engine, then merge."""
    run = prepare(cfg)
    todo = [s.index for s in run.shards() if not run.is_done(s.index)]
    if not todo and run.output_path.exists() and run.stats_json.is_file():
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
    per = run.config.cluster.shards_per_task
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
