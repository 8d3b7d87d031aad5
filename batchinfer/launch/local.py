"""Run shards here: `batchinfer run`, `batchinfer worker` and a Slurm array task. One engine runs
them in this process (launch/shardloop.py), or cluster.engines_per_task engine processes do
(launch/engines.py); alone, this process decides what a stop or a failure means for the task."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf
from tqdm.contrib.logging import logging_redirect_tqdm

from batchinfer import security
from batchinfer.config.engines import engine_devices, engines_per_task, task_gpus
from batchinfer.config.schema import Config
from batchinfer.engine.crashes import CRASHES_TO_ISOLATE
from batchinfer.engine.output import EngineOutput
from batchinfer.errors import BatchinferError, EngineFailure, RunDirError, Stopped
from batchinfer.inputs.shards import Shard
from batchinfer.launch import slurm
from batchinfer.launch.engines import run_engines
from batchinfer.launch.ranks import other_ranks
from batchinfer.launch.requeue import earns_another_attempt, requeue_for_another_attempt, requeue_on_stop
from batchinfer.launch.shardloop import ShardLoop, rows_done
from batchinfer.rundir.merge import merge
from batchinfer.rundir.passes import output_is_current
from batchinfer.rundir.prepare import prepare
from batchinfer.rundir.progress import EngineSlot
from batchinfer.rundir.stats import summary_line
from batchinfer.rundir.store import RunDir

log = logging.getLogger("batchinfer")


def run_shards(run: RunDir, indices: list[int], engine: Any = None) -> None:
    """Finish the given shards in this process with one engine, or with cluster.engines_per_task
    engine processes; stop signals commit first."""
    shards = [s for s in run.shards() if s.index in set(indices) and not run.shard_folder(s.index).is_done()]
    if not shards:
        return
    n = 1 if engine is not None else task_engines(run.config, len(shards))
    with security.private_umask(run.config.output.private):
        if n > 1:
            run_engines(run, shards, n)
            return
        with (
            bar_aware_logging(),
            EngineOutput(run.logs_dir, enabled=engine is None) as output,
            other_ranks(run) as ranks,
        ):
            run_alone(run, shards, engine, output, ranks)


def bar_aware_logging() -> contextlib.AbstractContextManager[None]:
    """batchinfer's console lines written through tqdm.write, so they never land on the progress bar's
    line (entered before EngineOutput, which then points the handler at the console)."""
    return logging_redirect_tqdm(loggers=[log]) if log.handlers else contextlib.nullcontext()


def task_engines(cfg: Config, n_shards: int) -> int:
    """Engines this task starts: cluster.engines_per_task for the GPUs it has, at most one per shard."""
    return min(engines_per_task(cfg, len(task_gpus(cfg))), n_shards)


def solo_slot(cfg: Config) -> Optional[EngineSlot]:
    """The engine slot of a task that runs one engine where cluster.engines_per_task asks for more
    (fewer shards left than engines): report then counts all the task's GPUs for its shards."""
    if cfg.cluster.engines_per_task == 1:
        return None
    return EngineSlot(index=0, of=1, devices=engine_devices())


def run_alone(run: RunDir, shards: list[Shard], engine: Any, output: EngineOutput, ranks: Any = None) -> None:
    """Run shards on one engine, this process deciding for the task: a stop requeues it on USR2
    under Slurm; a failure requeues it while cluster.max_attempts allows, and is raised."""
    total = sum(s.rows for s in shards)
    done = sum(rows_done(run, s.index) for s in shards)
    with ShardLoop(run, engine, output, run.path.name, solo_slot(run.config), total, done, ranks) as loop:
        try:
            loop.run(shards)
        except Stopped as e:
            requeue_on_stop(e.signum)
            raise
        except BatchinferError:
            raise  # the input or config is wrong: another attempt would fail the same way
        except Exception as e:
            index = loop.current.index if loop.current is not None else -1
            if slurm.this_job():
                # The worker counted the failure under the shard lock, against this submission's budget.
                if earns_another_attempt(run, index, loop.failures, e):
                    requeue_for_another_attempt()
                raise
            log.exception("shard %d failed", index)
            raise EngineFailure(
                f"shard {index} failed: {type(e).__name__}: {e} (traceback above). Committed rows are "
                f"safe: run the same command again to finish. Rows that were in flight run one at a time "
                f"first, and a row in flight at {CRASHES_TO_ISOLATE} engine deaths becomes an error row"
            ) from None


def run_local(cfg: DictConfig, engine: Any = None, prepared: Optional[Callable[[RunDir], None]] = None) -> RunDir:
    """`batchinfer run`: every shard here with one engine, then merge; prepared (the forecast record,
    tune/budget.py) sees DIR before the engine starts."""
    t0 = time.monotonic()
    run = prepare(cfg)
    todo = [s.index for s in run.shards() if not run.shard_folder(s.index).is_done()]
    if not todo and output_is_current(run):  # a finished pass (redo) not merged yet is merged below
        rows = (run.stats() or {}).get("rows")
        print(f"{run.path} is already complete: {rows} rows in {run.output_path}; nothing to do")
        return run
    if todo:
        if prepared is not None:
            prepared(run)
        # cluster.env is the engine's environment here as in a Slurm task (a tuned thread binding,
        # VLLM_* settings); an engine passed in has started already
        env = security.task_env(OmegaConf.to_container(cfg.cluster.env)) if engine is None else {}
        with security.applied_env(env):
            run_shards(run, todo, engine)
    stats = merge(run)
    print(summary_line(stats, run.output_path, time.monotonic() - t0))
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
