"""Submit shards as Slurm arrays (submitit) plus a merge job; resume and cancel a run's jobs."""

from __future__ import annotations

import contextlib
import logging
import os
import pkgutil
import shlex
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional, TypedDict

from omegaconf import DictConfig

from batchinfer import security, slurm_env, slurm_states
from batchinfer.config.schema import to_config
from batchinfer.errors import RunDirError, SlurmUnavailable, SubmissionRefused
from batchinfer.launch import slurm
from batchinfer.launch.executor import make_executor
from batchinfer.launch.jobs import ArrayRecord, JobsLine, all_job_ids, heal_streak, submissions, unrecorded_names
from batchinfer.launch.node_layout import layout_lines
from batchinfer.logs import plural
from batchinfer.redaction import record_json
from batchinfer.rundir.image_files import refuse_changed_images
from batchinfer.rundir.merge import incomplete_shards
from batchinfer.rundir.model_record import check_model_unchanged
from batchinfer.rundir.prepare import freeze_paths, prepare
from batchinfer.rundir.store import RunDir

log = logging.getLogger("batchinfer")
# What a queued job runs, by the names submitit pickles: jobs queued before an upgrade find them by
# these names. The package defines them, and its merge job submits through this module: they are
# looked up by name when a submission is made, as the job itself does, not imported (a ring).
TASK_FUNCTION = "batchinfer.launch:slurm_task"
MERGE_FUNCTION = "batchinfer.launch:slurm_merge"


class PlannedArray(TypedDict):
    """An array a dry run would submit: array index -> shards."""

    tasks: dict[int, list[int]]


class Submitted(TypedDict, total=False):
    """What submit_shards made: the submission's number, start time, log folder, job name, arrays
    and merge job; a dry run: its number and the arrays it would submit."""

    submission: int
    time: float
    folder: str
    name: str
    arrays: list[ArrayRecord] | list[PlannedArray]
    merge: str
    dry_run: bool


def job_name(run: RunDir, number: int) -> str:
    """A job name unique to this submission of DIR: `status` and `cancel` find its jobs by name
    when sbatch timed out before returning an id (the job may exist all the same)."""
    import hashlib

    where = hashlib.sha256(str(run.path.resolve()).encode()).hexdigest()[:4]  # two DIRs, same config
    return f"bi-{run.run['fingerprint'][:8]}-{number}-{where}"


def _record(run: RunDir, line: JobsLine) -> None:
    """Append one line to DIR/jobs.jsonl and make it durable before the next sbatch."""
    text = record_json(line) + "\n"
    with security.private_umask(run.config.output.private), open(run.path / "jobs.jsonl", "a") as f:
        mode = security.record_mode(run.path, text)
        if mode is not None:
            os.fchmod(f.fileno(), stat.S_IMODE(os.fstat(f.fileno()).st_mode) & mode)  # its other lines too
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def submit_shards(run: RunDir, indices: list[int], dry_run: bool = False, heal: bool = False) -> Submitted:
    """Submit arrays over the given shards (split at MaxArraySize) and an afterany merge job.

    jobs.jsonl gets a line before the first sbatch (the job name), one per array as soon as sbatch
    returns its id, and one for the merge job: a submission refused or cut short half way leaves
    every job it created findable by `cancel` and `status`."""
    c = run.config
    cluster = c.cluster
    slurm.check_directives(cluster)
    engines = slurm.check_gpus(c)
    per = cluster.shards_per_task
    tasks = [indices[i : i + per] for i in range(0, len(indices), per)]
    limit = slurm.max_array_size()
    chunks = slurm.split_tasks(tasks, limit)
    number = max((s["submission"] for s in submissions(run)), default=-1) + 1
    folder = run.logs_dir / f"submission-{number:03d}"
    slurm.check_log_folder(folder)
    name = job_name(run, number)
    # the secrets the jobs get from this shell (cluster.env's struck ones, cluster.env_inherit): a dry
    # run refuses a missing one as the submission would (attack42b K13: it planned as if all was well)
    security.secret_env(cluster.env, cluster.env_inherit)
    if dry_run:
        print(f"job name: {name}")
        if cluster.nodes_per_task > 1:
            print("\n".join(layout_lines(c, len(chunks[0]), folder, name)))
        else:
            print(f"engines per task: {_engines_line(c, engines)}")
        for n, chunk in enumerate(chunks):
            print(f"array {n}: {len(chunk)} tasks, sbatch parameters {slurm.array_parameters(cluster, len(chunk))}")
            for i, shards in enumerate(chunk):
                print(f"  task {i}: shards {shards}")
        print(f"merge job: {slurm.merge_parameters(cluster, ['<array ids>'])}")
        return {"submission": number, "dry_run": True, "arrays": [{"tasks": dict(enumerate(ch))} for ch in chunks]}
    security.make_private(run.path, c.output.private)  # set by `resume output.private=true`
    if cluster.nodes_per_task > 1:  # what the tasks ask Slurm for, said before sbatch is asked
        print("\n".join(layout_lines(c, len(chunks[0]), folder, name)))
    record = Submitted(submission=number, time=time.time(), folder=str(folder), name=name)
    _record(run, {**record, "arrays_planned": len(chunks), **({"heal": True} if heal else {})})
    arrays: list[ArrayRecord] = []
    # Secrets reach the jobs through sbatch's environment (--export=ALL), never a file; the jobs
    # keep this umask, so with output.private their logs and parts are private too.
    try:
        with security.submission_env(cluster.env, cluster.env_inherit), security.private_umask(c.output.private):
            for n, chunk in enumerate(chunks):
                ex = make_executor(folder, {**slurm.array_parameters(cluster, len(chunk)), "job_name": name})
                jobs = ex.map_array(pkgutil.resolve_name(TASK_FUNCTION), [str(run.path)] * len(chunk), chunk)
                array = {"job_id": jobs[0].job_id.split("_")[0], "tasks": {str(i): ch for i, ch in enumerate(chunk)}}
                _record(run, {"submission": number, "array": n, **array})
                arrays.append(array)
            after = [a["job_id"] for a in arrays]
            mex = make_executor(folder, {**slurm.merge_parameters(cluster, after), "job_name": name})
            merge_job = mex.submit(pkgutil.resolve_name(MERGE_FUNCTION), str(run.path))
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
        f"submitted {plural(len(indices), 'shard')} of {run.path} as {plural(len(tasks), 'array task')} (job {ids}); merge job {merge_job.job_id}"
    )
    shown = shlex.quote(str(run.path))  # commands to copy into a shell
    print(f"  status:  batchinfer status {shown}")
    print(f"  resume:  batchinfer resume {shown}    (after preemption, time limits or failures)")
    print(f"  cancel:  batchinfer cancel {shown}")
    return record


def _engines_line(c: Any, n: int) -> str:
    """What each array task starts, for the dry run: N engines and the GPUs (or CPU cores) of each."""
    setting = f"cluster.engines_per_task={c.cluster.engines_per_task}"
    have = c.cluster.gpus_per_task
    if have:
        each = c.model.tensor_parallel_size * c.model.pipeline_parallel_size
        idle = have - n * each
        spare = f", {idle} of cluster.gpus_per_task={have} idle" if idle else ""
        return f"{n} ({setting}), {each} GPU{'s' * (each != 1)} each{spare}"
    cpus = c.cluster.cpus_per_task
    if n == 1:
        return f"1 ({setting}), on the task's CPU cores"
    share = f" (cluster.cpus_per_task={cpus}: {cpus // n}+ each)" if cpus else ""
    return f"{n} ({setting}), CPU cores split {n} ways{share}"


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


def _submitted_so_far(run: RunDir, arrays: list[ArrayRecord]) -> str:
    shown = shlex.quote(str(run.path))
    if not arrays:
        return f"Nothing of this submission was queued; {run.path} stays usable"
    done = ", ".join(f"array {a['job_id']} (shards {sum(a['tasks'].values(), [])})" for a in arrays)
    return (
        f"Already queued: {done}, recorded in jobs.jsonl; `batchinfer cancel {shown}` cancels them, "
        f"or let them run and resume the rest later"
    )


def heal(run: RunDir) -> Optional[Submitted]:
    """The merge job's first step: shards whose array task was killed by USR2 before its worker
    could act on it (a preemption notice in the instant Python starts) are submitted again, with
    a merge job of their own, at most cluster.max_attempts times in a row; returns that submission."""
    todo = set(incomplete_shards(run))
    subs = submissions(run)
    if not todo or not subs:
        return None
    last = subs[-1]
    tasks = {  # a submission of one task is a plain job: sacct names it by its job id
        (a["job_id"] if len(a["tasks"]) == 1 and "_" not in a["job_id"] else f"{a['job_id']}_{i}"): shards
        for a in last["arrays"]
        for i, shards in a["tasks"].items()
    }
    unfinished = [task for task, of_task in tasks.items() if set(of_task) & todo]
    if not unfinished:
        return None
    killed = slurm.tasks_killed_by_usr2([a["job_id"] for a in last["arrays"]], unfinished)
    shards = sorted({s for task, of_task in tasks.items() if task in killed for s in of_task} & todo)
    if not shards:
        return None
    try:  # anything of DIR still queued or running (but this merge job) would write those shards
        others = set(active_jobs(run)) - {slurm_env.current().job_id}
    except SlurmUnavailable as e:
        log.warning("shards %s not submitted again: %s", shards, e)
        return None
    if others:
        log.warning("shards %s not submitted again: jobs of DIR still queued or running (%s)", shards, sorted(others))
        return None
    limit = run.config.cluster.max_attempts
    streak = heal_streak(subs)
    if streak >= limit:
        log.error(
            "shards %s: their tasks were killed by USR2 again; %d automatic resubmissions in a row "
            "(cluster.max_attempts) is the limit: `batchinfer resume %s` submits them",
            shards,
            streak,
            shlex.quote(str(run.path)),
        )
        return None
    log.warning(
        "shards %s: their tasks were killed by USR2 before the worker could act on it; submitting them again "
        "(%d of %d in a row)",
        shards,
        streak + 1,
        limit,
    )
    with _outside_this_job():
        return submit_shards(run, shards, heal=True)


@contextlib.contextmanager
def _outside_this_job() -> Iterator[None]:
    """This job's SLURM_* variables out of the environment while sbatch runs (its jobs get their
    own; srun would read a stale SLURM_MEM_PER_CPU or SLURM_CPUS_PER_TASK), SLURM_CONF kept."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("SLURM_") and k != "SLURM_CONF"}
    try:
        yield
    finally:
        os.environ.update(saved)


def submit(cfg: DictConfig, dry_run: bool = False, check: Optional[Callable[[RunDir], None]] = None) -> RunDir:
    """`batchinfer submit`: prepare DIR, submit every incomplete shard, return at once; check (the
    forecast and budget, tune/budget.py) sees DIR before any sbatch and may refuse."""
    # What sbatch cannot take is refused before DIR is made.
    slurm.check_directives(to_config(cfg).cluster)
    if cfg.output.dir:
        slurm.check_log_folder(Path(cfg.output.dir) / "logs" / "submission-000")
    run = prepare(cfg)
    todo = incomplete_shards(run)
    if not todo:
        print(f"{run.path}: every shard is done; `batchinfer merge {run.path}` writes the output if it is missing")
        return run
    if check is not None:
        check(run)
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
    return {j: s for j, s in states.items() if s in slurm_states.ACTIVE}


def refuse_active_jobs(run: RunDir, advice: str) -> None:
    """RunDirError naming DIR's jobs still queued or running: a second submission of its shards
    would run beside them (`resume`, and `redo` of a pass it submitted)."""
    active = active_jobs(run)
    if active:
        shown = ", ".join(f"{j} {s}" for j, s in sorted(active.items())[:10])
        raise RunDirError(f"{run.path} still has jobs queued or running ({shown}); {advice}")


def resume(run_dir: str, overrides: list[str], force: bool = False, dry_run: bool = False) -> RunDir:
    """`batchinfer resume DIR`: resubmit only incomplete shards with the frozen config."""
    run = RunDir(run_dir)
    if not force:
        refuse_active_jobs(run, "wait, `batchinfer cancel` them, or pass --force")
    if overrides:
        apply_resource_overrides(run, overrides)
    todo = incomplete_shards(run)
    if todo:
        check_model_unchanged(run)  # the tasks would refuse it too, each after its wait in the queue
        refuse_changed_images(run.path)
    if not todo:
        run.stats()  # a stats.json merge cannot read is refused, naming it, never called complete
        print(
            f"{run.path}: every shard is done; nothing to resume (`batchinfer merge {run.path}` if output is missing)"
        )
        return run
    submit_shards(run, todo, dry_run=dry_run)
    return run


def apply_resource_overrides(run: RunDir, overrides: list[str]) -> None:
    """Apply key=value overrides to the frozen config; keys that change outputs are refused."""
    from batchinfer.config.checks import validate
    from batchinfer.config.compose import apply_overrides
    from batchinfer.config.fingerprint import changed_keys, fingerprint_keys
    from batchinfer.config.schema import structured, to_dict

    record = run.run
    new = structured(record["config"])
    apply_overrides(new, overrides)  # Hydra's grammar, as on the submit command line
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
    subs = submissions(run)  # read once: a line it ignores is warned about once
    ids = all_job_ids(run, subs)
    names = unrecorded_names(run, subs)  # submissions cut short: their jobs may exist without a recorded id
    missed = slurm.cancel(ids, names)
    done = [i for i in ids if i not in missed]
    by_name = f"; and any job named {', '.join(names)}" if names else ""
    if ids or names:
        print(f"cancelled {len(done)} jobs of {run.path}: {' '.join(done) or '(none)'}{by_name}")
    else:
        print(f"{run.path}: no jobs recorded")
    if missed:
        print(
            "not cancelled (already finished, or unknown to Slurm): "
            + ", ".join(f"{j} ({r})" for j, r in missed.items())
        )
    return done
