"""Fan shards out: locally in this process, or as a Slurm array (submitit) plus a merge job."""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig

from batchinfer import security, slurm
from batchinfer.data import Shard
from batchinfer.dtype import settle
from batchinfer.engine_output import EngineOutput
from batchinfer.errors import (
    BatchinferError,
    ConfigError,
    EngineFailure,
    RequeueFailed,
    RunDirError,
    SlurmUnavailable,
    SubmissionRefused,
)
from batchinfer.merge import incomplete_shards, merge
from batchinfer.plan import freeze_paths, prepare
from batchinfer.report import all_job_ids, submissions, unrecorded_names
from batchinfer.store import RunDir, read_json, refused_write, storage_error

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

    def __init__(self, c: dict[str, Any], stop: Any, engine: Any = None, run_path: Optional[Path] = None):
        self.c = c
        self.stop = stop
        self.engine = engine
        # `model.dtype: auto` settled for the whole run in DIR/dtype.json (None: for this machine)
        self.dtype = settle(run_path, c["model"]["dtype"]) if run_path is not None else None
        if engine is not None:
            from batchinfer.engine import model_key

            if engine.key != model_key(c):
                raise RunDirError("the engine passed in was built for another model config")
            if self.dtype not in (None, "auto", getattr(engine, "dtype", self.dtype)):
                raise RunDirError(f"the engine passed in runs {engine.dtype}; this run's shards use {self.dtype}")

    def __call__(self) -> Any:
        if self.engine is None:
            from batchinfer.engine import Engine

            log.info("starting vLLM engine for %s", self.c["model"]["path"])
            # Block stop signals while the engine starts: its processes inherit the mask (a
            # group-wide USR2 cannot kill them) and a signal sent meanwhile stays pending.
            self.stop.block()
            try:
                self.engine = Engine(self.c, self.dtype)
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
    shards = [s for s in run.shards() if s.index in set(indices) and not run.is_done(s.index)]
    if not shards:
        return
    with (
        security.private_umask(run.run["config"]["output"]["private"]),
        EngineOutput(run.logs_dir, enabled=engine is None) as output,
    ):
        _run_shards(run, shards, engine, output)


def _run_shards(run: RunDir, shards: list[Shard], engine: Any, output: EngineOutput) -> None:
    from batchinfer.worker import CRASHES_TO_ISOLATE, ShardWorker, StopFlag, Stopped

    stop = StopFlag()
    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)}
    holder = EngineHolder(run.run["config"], stop, engine, run.path)
    committed = sum(_rows_done(run, s.index) for s in shards)
    bar = progress_bar(sum(s.rows for s in shards), committed, desc=run.path.name, file=output.bar_file())
    current = shards[0]
    worker = ShardWorker(run, holder, stop, bar)
    try:
        stop.install()
        for current in shards:
            worker.run_shard(current)
    except Stopped as e:
        _stopped(e.signum)
        raise
    except BatchinferError:
        raise  # the input or config is wrong: another attempt would fail the same way
    except Exception as e:
        if isinstance(e, OSError) and refused_write(e) is not None:
            raise storage_error(Path(e.filename or run.path), e) from None
        if stop.signum is not None:  # the signal reached the engine too: a stop, not a failure
            _stopped(stop.signum)
            raise Stopped(stop.signum) from e
        if slurm.this_job():
            # The worker counted the failure under the shard lock, against this submission's budget.
            failures = worker.failures
            limit = run.run["config"]["cluster"]["max_attempts"]
            if failures is None:
                log.error("shard %d failed outside its shard lock (%s): not requeueing", current.index, e)
            elif failures < limit:
                log.error("shard %d failed (%s), attempt %d of %d: requeueing", current.index, e, failures, limit)
                slurm.requeue_self()
            else:
                log.error(
                    "shard %d failed %d times in this submission (cluster.max_attempts): giving up",
                    current.index,
                    failures,
                )
            raise
        log.exception("shard %d failed", current.index)
        raise EngineFailure(
            f"shard {current.index} failed: {type(e).__name__}: {e} (traceback above). Committed rows are "
            f"safe: run the same command again to finish. Rows that were in flight run one at a time "
            f"first, and a row in flight at {CRASHES_TO_ISOLATE} engine deaths becomes an error row"
        ) from None
    finally:
        bar.close()
        holder.close(owned=engine is None)
        for s, h in saved.items():
            signal.signal(s, h)


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


# ---------------------------------------------------------------- Slurm


def slurm_task(run_dir: str, shards: list[int]) -> None:
    """What one array task runs (submitit pickles this call)."""
    from batchinfer.cli import setup_logging
    from batchinfer.worker import Stopped

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
    """What the merge job runs: refuses, naming them, when shards are incomplete."""
    from batchinfer.cli import setup_logging

    setup_logging()
    stats = merge(RunDir(run_dir))
    return f"merged {stats['rows']} rows"


def job_name(run: RunDir, number: int) -> str:
    """A job name unique to this submission of DIR: `status` and `cancel` find its jobs by name
    when sbatch timed out before returning an id (the job may exist all the same)."""
    import hashlib

    where = hashlib.sha256(str(run.path.resolve()).encode()).hexdigest()[:4]  # two DIRs, same config
    return f"bi-{run.run['fingerprint'][:8]}-{number}-{where}"


def _record(run: RunDir, line: dict[str, Any]) -> None:
    """Append one line to DIR/jobs.jsonl and make it durable before the next sbatch."""
    with security.private_umask(run.run["config"]["output"]["private"]), open(run.path / "jobs.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")
        f.flush()
        os.fsync(f.fileno())


def submit_shards(run: RunDir, indices: list[int], dry_run: bool = False) -> dict[str, Any]:
    """Submit arrays over the given shards (split at MaxArraySize) and an afterany merge job.

    jobs.jsonl gets a line before the first sbatch (the job name), one per array as soon as sbatch
    returns its id, and one for the merge job: a submission refused or cut short half way leaves
    every job it created findable by `cancel` and `status`."""
    c = run.run["config"]
    cluster = c["cluster"]
    slurm.check_gpus(c)
    per = cluster["shards_per_task"]
    tasks = [indices[i : i + per] for i in range(0, len(indices), per)]
    limit = slurm.max_array_size()
    chunks = slurm.split_tasks(tasks, limit)
    number = max((s["submission"] for s in submissions(run)), default=-1) + 1
    folder = run.logs_dir / f"submission-{number:03d}"
    slurm.check_log_folder(folder)
    name = job_name(run, number)
    if dry_run:
        print(f"job name: {name}")
        for n, chunk in enumerate(chunks):
            print(f"array {n}: {len(chunk)} tasks, sbatch parameters {slurm.array_parameters(cluster, len(chunk))}")
            for i, shards in enumerate(chunk):
                print(f"  task {i}: shards {shards}")
        print(f"merge job: {slurm.merge_parameters(cluster, ['<array ids>'])}")
        return {"submission": number, "dry_run": True, "arrays": [{"tasks": dict(enumerate(ch))} for ch in chunks]}
    security.make_private(run.path, c["output"]["private"])  # set by `resume output.private=true`
    record: dict[str, Any] = {"submission": number, "time": time.time(), "folder": str(folder), "name": name}
    _record(run, {**record, "arrays_planned": len(chunks)})
    arrays: list[dict[str, Any]] = []
    # Secrets reach the jobs through sbatch's environment (--export=ALL), never a file; the jobs
    # keep this umask, so with output.private their logs and parts are private too.
    try:
        with security.submission_env(cluster["env"]), security.private_umask(c["output"]["private"]):
            for n, chunk in enumerate(chunks):
                ex = slurm.executor(folder, {**slurm.array_parameters(cluster, len(chunk)), "job_name": name})
                jobs = ex.map_array(slurm_task, [str(run.path)] * len(chunk), chunk)
                array = {"job_id": jobs[0].job_id.split("_")[0], "tasks": {str(i): ch for i, ch in enumerate(chunk)}}
                _record(run, {"submission": number, "array": n, **array})
                arrays.append(array)
            after = [a["job_id"] for a in arrays]
            mex = slurm.executor(folder, {**slurm.merge_parameters(cluster, after), "job_name": name})
            merge_job = mex.submit(slurm_merge, str(run.path))
    except SlurmUnavailable as e:
        raise SlurmUnavailable(
            e.command,
            e.reason,
            f"the job may have been created all the same, under the name {name}: "
            f"{_submitted_so_far(run, arrays)}; `batchinfer status` looks it up by name and "
            f"`batchinfer cancel {shlex.quote(str(run.path))}` cancels it",
        ) from None
    except Exception as e:
        stderr = _sbatch_refusal(e)
        if stderr is None:
            raise
        what = f"array {len(arrays)} of {len(chunks)}" if len(arrays) < len(chunks) else "the merge job"
        raise SubmissionRefused(
            f"sbatch refused {what} of submission {number}: {stderr} -> {refusal_hint(stderr, run)}. "
            f"{_submitted_so_far(run, arrays)}"
        ) from None
    _record(run, {"submission": number, "merge": merge_job.job_id})
    record.update(arrays=arrays, merge=merge_job.job_id)
    ids = ", ".join(a["job_id"] for a in arrays)
    print(
        f"submitted {len(indices)} shards of {run.path} as {len(tasks)} array tasks (job {ids}); merge job {merge_job.job_id}"
    )
    shown = shlex.quote(str(run.path))  # commands to copy into a shell
    print(f"  status:  batchinfer status {shown}")
    print(f"  resume:  batchinfer resume {shown}    (after preemption, time limits or failures)")
    print(f"  cancel:  batchinfer cancel {shown}")
    return record


def _sbatch_refusal(e: BaseException) -> Optional[str]:
    """sbatch's own error line, if e is sbatch refusing (submitit's FailedJobError or CalledProcessError)."""
    import subprocess

    from submitit.core.utils import FailedJobError

    if isinstance(e, subprocess.CalledProcessError):
        return slurm.first_error_line(str(e.stderr or e.output or f"exit {e.returncode}"))
    if isinstance(e, FailedJobError):
        return slurm.first_error_line(str(e))
    return None


# sbatch's words -> the setting that decides them, with an example; the first match names it
REFUSAL_HINTS = [
    (r"gres|generic resource|gpu", "set cluster.gpus_per_task (0 on a CPU partition)", "cluster.gpus_per_task=0"),
    # "Job violates accounting/QOS policy", QOSMaxSubmitJobPerUserLimit, AssocMaxJobsLimit, ...
    (r"qos|policy|assocmax|submit ?limit", "set cluster.qos, or lower cluster.array_parallelism", "cluster.qos=NAME"),
    # "Invalid account or account/partition combination specified": the account is wrong
    (r"invalid account|account/partition|association", "set cluster.account to one of yours", "cluster.account=NAME"),
    (r"partition", "set cluster.partition to one you may use (`sinfo -s` lists them)", "cluster.partition=NAME"),
    (r"time", "set cluster.time (minutes) within the partition's limit", "cluster.time=MINUTES"),
    (r"memory|mem", "set cluster.mem (null: the partition's default)", "cluster.mem=null"),
    (r"feature|constraint", "set cluster.constraint to features the nodes have", "cluster.constraint=null"),
    (r"cpu", "set cluster.cpus_per_task", "cluster.cpus_per_task=N"),
    (r"limit", "set cluster.qos, or lower cluster.array_parallelism", "cluster.array_parallelism=N"),
]


def refusal_hint(stderr: str, run: RunDir) -> str:
    """Which cluster.* setting to change for sbatch's error message, and the command that does it."""
    import re

    low = stderr.lower()
    advice, example = "check the cluster.* settings (and cluster.sbatch_extra)", "cluster.KEY=VALUE"
    for pattern, hint, ex in REFUSAL_HINTS:
        if re.search(pattern, low):
            advice, example = hint, ex
            break
    return f"{advice}: `batchinfer resume {shlex.quote(str(run.path))} {example}`"


def _submitted_so_far(run: RunDir, arrays: list[dict[str, Any]]) -> str:
    shown = shlex.quote(str(run.path))
    if not arrays:
        return f"Nothing of this submission was queued; {run.path} stays usable"
    done = ", ".join(f"array {a['job_id']} (shards {sum(a['tasks'].values(), [])})" for a in arrays)
    return (
        f"Already queued: {done}, recorded in jobs.jsonl; `batchinfer cancel {shown}` cancels them, "
        f"or let them run and resume the rest later"
    )


def submit(cfg: DictConfig, dry_run: bool = False) -> RunDir:
    """`batchinfer submit`: prepare DIR, submit every incomplete shard, return at once."""
    run = prepare(cfg)
    todo = incomplete_shards(run)
    if not todo:
        print(f"{run.path}: every shard is done; `batchinfer merge {run.path}` writes the output if it is missing")
        return run
    submit_shards(run, todo, dry_run=dry_run)
    return run


def active_jobs(run: RunDir) -> dict[str, str]:
    """Jobs of DIR still queued or running (also those only known by their job name)."""
    try:
        states = slurm.job_states(all_job_ids(run), names=unrecorded_names(run))
    except SlurmUnavailable as e:
        raise SlurmUnavailable(
            e.command, e.reason, "cannot tell whether jobs of DIR still run; try again, or pass --force"
        ) from None
    return {j: s for j, s in states.items() if s in slurm.ACTIVE_STATES}


def resume(run_dir: str, overrides: list[str], force: bool = False, dry_run: bool = False) -> RunDir:
    """`batchinfer resume DIR`: resubmit only incomplete shards with the frozen config."""
    run = RunDir(run_dir)
    active = {} if force else active_jobs(run)
    if active:
        shown = ", ".join(f"{j} {s}" for j, s in sorted(active.items())[:10])
        raise RunDirError(
            f"{run.path} still has jobs queued or running ({shown}); wait, `batchinfer cancel` them, or pass --force"
        )
    if overrides:
        apply_resource_overrides(run, overrides)
    todo = incomplete_shards(run)
    if not todo:
        print(
            f"{run.path}: every shard is done; nothing to resume (`batchinfer merge {run.path}` if output is missing)"
        )
        return run
    submit_shards(run, todo, dry_run=dry_run)
    return run


def apply_resource_overrides(run: RunDir, overrides: list[str]) -> None:
    """Apply key=value overrides to the frozen config; keys that change outputs are refused."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from batchinfer.config import Config, changed_keys, fingerprint_keys, quote_literals, to_dict, validate

    record = run.run
    new = OmegaConf.merge(OmegaConf.structured(Config), record["config"])
    try:  # Hydra's grammar, as on the submit command line
        for ov in OverridesParser.create().parse_overrides(quote_literals(overrides)):
            OmegaConf.update(new, ov.key_or_group, ov.value(), merge=True, force_add=ov.is_add())
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(str(e).splitlines()[0]) from None
    validate(new)
    c = to_dict(new)
    fp_input = record["fingerprint_keys"]["input.fingerprint"]
    changed = changed_keys(record["fingerprint_keys"], fingerprint_keys(c, fp_input))
    if changed:
        raise RunDirError(f"resume accepts only settings that do not change outputs; refused: {', '.join(changed)}")
    record["config"] = freeze_paths(run, c)  # tasks keep reading the frozen copies, never the user's files
    run.write_run(record)


def cancel(run_dir: str) -> list[str]:
    """`batchinfer cancel DIR`: scancel every job recorded for DIR."""
    run = RunDir(run_dir)
    ids = all_job_ids(run)
    names = unrecorded_names(run)  # submissions cut short: their jobs may exist without a recorded id
    slurm.cancel(ids, names)
    by_name = f"; and any job named {', '.join(names)}" if names else ""
    if ids or names:
        print(f"cancelled {len(ids)} jobs of {run.path}: {' '.join(ids)}{by_name}")
    else:
        print(f"{run.path}: no jobs recorded")
    return ids
