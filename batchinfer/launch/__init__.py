"""Launch: running shards here (`local`: one engine in this process through `shardloop`, or
several engine processes: `engines` for the task, `member` for each engine, `protocol` between
them), when a task asks to run again (`requeue`), Slurm's commands (`slurm`), submitit's executor
(`executor`), submitting a run as Slurm arrays (`submit`), and the submissions recorded in
DIR/jobs.jsonl (`jobs`); for an engine over several nodes, the other nodes' engine ranks (`ranks`)
and what such a task asks Slurm for (`node_layout`).

Imports everything below it (config .. engine), never insight. `slurm_task` and `slurm_merge`
are what submitit pickles by name for a queued job, so they are defined here, at the names
versions before the packages pickled (`batchinfer.launch.slurm_task`)."""

import logging

from batchinfer.errors import RequeueFailed
from batchinfer.launch.local import run_shards
from batchinfer.logs import setup_logging
from batchinfer.rundir.merge import merge
from batchinfer.rundir.store import RunDir

log = logging.getLogger("batchinfer")


def slurm_task(run_dir: str, shards: list[int]) -> None:
    """What one array task runs (submitit pickles this call)."""
    import signal

    # Before anything else: submitit's own USR2 handler would requeue behind the worker's back,
    # and the engine's processes must start with USR2 blocked (they inherit the mask).
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
    from batchinfer.errors import Stopped

    setup_logging()
    try:
        run_shards(RunDir(run_dir), shards)
    except Stopped as e:
        log.warning("%s; committed rows are safe", e)
    except RequeueFailed as e:
        # raised on: submitit then exits non-zero and Slurm shows FAILED; status quotes this line
        log.error("error: %s", e)
        raise


def slurm_merge(run_dir: str) -> str:
    """What the merge job runs: submits again the shards of tasks killed by USR2 before their
    worker owned it (submit.heal); otherwise merges, refusing, naming them, incomplete shards."""
    from batchinfer.launch.submit import heal

    setup_logging()
    run = RunDir(run_dir)
    again = heal(run)
    if again is not None:
        return f"submitted shards of killed tasks again as submission {again['submission']}; its merge job merges"
    stats = merge(run)
    return f"merged {stats['rows']} rows"
