"""`batchinfer tune ... cluster=slurm`: the whole tune as one Slurm job on the target partition
(submitit, as `submit` submits), so a GPU node is tuned on a GPU node. The login node records the
job in TUNE/job.json, prints its id and where the results appear, and (unless --no-wait) follows
its log and prints the table once the job has written tune.json."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig

from batchinfer import security, slurm_states
from batchinfer.errors import BatchinferError, ConfigError, RunDirError, SlurmUnavailable, Stopped, SubmissionRefused
from batchinfer.launch import slurm
from batchinfer.launch.executor import make_executor
from batchinfer.redaction import record_json
from batchinfer.tune.command import Options, owned_folder, tune, tune_folder
from batchinfer.tune.job import RESULT_FILE, JobState, TuneJob, job_state, read_record, wait_seconds, write_record
from batchinfer.tune.results import format_result
from batchinfer.tune.settings import try_secrets

log = logging.getLogger("batchinfer")
# Beyond --minutes (the trials' budget), the job's time limit leaves this for drawing the pilot
# (reading and tokenizing the corpus) and closing the last engine.
MARGIN_MINUTES = 20
UNKNOWN_POLLS = 6  # polls Slurm may not know a job it accepted before the wait gives up on it


class TuneJobFailed(BatchinferError):
    """The tune job ended without writing its result: its state, its log's error line, its log."""

    exit_code = 1


def job_minutes(cluster_time: int, budget_minutes: float) -> int:
    """The tune job's time limit: cluster.time, or the budget plus MARGIN_MINUTES when longer."""
    return max(int(cluster_time), math.ceil(budget_minutes) + MARGIN_MINUTES)


def job_parameters(cluster: Any, minutes: int, name: str) -> dict[str, Any]:
    """submitit parameters of the tune job: an array task's resources (partition, account, qos,
    GPUs, CPUs, memory, constraint, setup, environment), one plain job, never requeued (a tune
    starts over from nothing, so a requeue would only spend the allocation twice)."""
    params = slurm.array_parameters(cluster, 1)
    params.pop("array_parallelism", None)
    extra = {k: v for k, v in params.pop("additional_parameters", {}).items() if k not in ("requeue", "no_requeue")}
    # --no-requeue: a node failure or preemption must not run it again (Slurm's JobRequeue default)
    return {**params, "time": minutes, "job_name": name, "additional_parameters": {**extra, "no_requeue": True}}


def _check_folder(folder: Path) -> None:
    """Slurm cannot take a log path with a newline or a % (its filename patterns)."""
    for char, why in (("\n", "a newline"), ("%", "a % (Slurm reads %j, %A... in log paths)")):
        if char in str(folder):
            raise ConfigError(f"the tune folder {str(folder)!r} contains {why}; choose another with --out")


def _refuse_running(folder: Path) -> None:
    """A second tune job on the same folder would write the same files: refused while one is active."""
    old = read_record(folder)
    if old is None or not old.job_id:
        return
    st = job_state(folder)
    if st.active:
        raise RunDirError(
            f"{folder}: its tune job {old.job_id} is still {st.state}; wait for it "
            f"(`batchinfer status {shlex.quote(str(folder))}`), cancel it, or tune into another --out"
        )


def request(opts: Options, folder: Path) -> dict[str, Any]:
    """What the job composes and tunes with: the login node's working directory (relative paths in
    overrides mean the same there), the overrides and the options, the folder fixed."""
    config_dir = str(Path(opts.config_dir).resolve()) if opts.config_dir else None
    options = asdict(replace(opts, out=str(folder), config_dir=config_dir))
    return {"cwd": os.getcwd(), "overrides": list(opts.overrides), "config_dir": config_dir, "options": options}


def submit_tune(cfg: DictConfig, opts: Options, say: Callable[[str], None] = print) -> tuple[Path, TuneJob]:
    """Record and submit the tune job; say its id, where the results appear, and the commands."""
    c, fp, folder = tune_folder(cfg, opts)
    cluster = c.cluster
    slurm.check_directives(cluster)
    if cluster.nodes_per_task > 1:
        raise ConfigError(
            f"cluster.nodes_per_task={cluster.nodes_per_task}: tune runs one engine on one node; "
            "tune a one-node setting (cluster.nodes_per_task=1), the forecast scales it"
        )
    _check_folder(folder)
    with owned_folder(folder, opts):  # refused: another's folder, or a tune in it now
        _refuse_running(folder)
        return _submit(c, opts, fp, folder, say)


def _submit(c: Any, opts: Options, fp: str, folder: Path, say: Callable[[str], None]) -> tuple[Path, TuneJob]:
    cluster = c.cluster
    minutes = job_minutes(cluster.time, opts.minutes)
    name = f"bi-tune-{fp[:8]}-{hashlib.sha256(str(folder).encode()).hexdigest()[:4]}"
    job = TuneJob(name, str(folder / "logs"), time.time(), minutes, request(opts, folder))
    write_record(folder, job)  # before sbatch: `cancel` finds the job by name if sbatch times out
    secrets = try_secrets(list(opts.tries or []))  # job.json strikes them: the job's environment carries them
    with (
        security.submission_env(cluster.env, cluster.env_inherit),
        security.applied_env(dict(secrets)),
        security.private_umask(c.output.private),
    ):
        ex = make_executor(folder / "logs", job_parameters(cluster, minutes, name))
        try:
            submitted = ex.submit(tune_job, str(folder))
        except SlurmUnavailable as e:
            raise SlurmUnavailable(
                e.command, e.reason, f"the job may exist all the same (name {name}); `batchinfer cancel {folder}`"
            ) from None
        except subprocess.CalledProcessError as e:
            stderr = slurm.first_error_line(str(e.stderr or e.output or f"exit {e.returncode}"))
            raise SubmissionRefused(
                f"sbatch refused the tune job: {stderr} -> check cluster.partition, account, qos, gpus_per_task, "
                f"cpus_per_task, mem and time ({minutes} min asked: cluster.time or --minutes + {MARGIN_MINUTES})"
            ) from None
    job = replace(job, job_id=str(submitted.job_id))
    write_record(folder, job)
    shown = shlex.quote(str(folder))
    where = f" on partition {cluster.partition}" if cluster.partition else ""
    say(f"submitted the tune as Slurm job {job.job_id}{where} (time limit {minutes} min)")
    say(f"  results: {folder}/tune.md, tune.png, tune.json, conf/tuned/best.yaml")
    say(f"  status:  batchinfer status {shown}")
    say(f"  cancel:  batchinfer cancel {shown}")
    return folder, job


def relay(path: Optional[Path], offset: int) -> int:
    """batchinfer's own lines the job logged since offset, to stderr; the new offset."""
    if path is None or not path.is_file():
        return offset
    with path.open("rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1  # a line still being written waits for the next poll
    for line in data[:end].decode(errors="replace").splitlines():
        if line.startswith("[batchinfer "):
            print(line, file=sys.stderr, flush=True)
    return offset + end


def wait(folder: Path, job: TuneJob) -> JobState:
    """Until the job has ended (or ended, as far as Slurm can tell, with its result written)."""
    offset, unknown = 0, 0
    while True:
        st = job_state(folder)
        offset = relay(job.log_path(), offset)
        unknown = unknown + 1 if st.state is None and not st.note else 0
        if st.state in slurm_states.FINAL or (st.done and not st.active) or unknown >= UNKNOWN_POLLS:
            relay(job.log_path(), offset)
            return st
        time.sleep(wait_seconds(job.submitted))


def run(cfg: DictConfig, opts: Options, follow: bool, as_json: bool) -> int:
    """`tune ... cluster=slurm`: submit; unless told not to, wait and print the result."""
    say = (lambda s: print(s, file=sys.stderr)) if as_json else print
    folder, job = submit_tune(cfg, opts, say)
    if not follow:
        return 0
    say(f"waiting for job {job.job_id} (Ctrl-C stops waiting, not the job)")
    try:
        st = wait(folder, job)
    except KeyboardInterrupt:
        say(f"stopped waiting; the tune job {job.job_id} goes on: `batchinfer status {shlex.quote(str(folder))}`")
        return 130
    if not st.done:
        raise TuneJobFailed(
            f"the tune job {job.job_id} ended {st.state or '(state unknown)'} without a result: "
            f"{st.error or 'no error line'}; its log: {st.log}"
        )
    result = json.loads((folder / RESULT_FILE).read_text(encoding="utf-8"))
    print(record_json(result, indent=2) if as_json else format_result(result))
    if not as_json:
        print(f"written: {folder}/ (tune.md, tune.png, tune.json, conf/)")
    return 0 if result["best"]["name"] is not None else 1


def _stop(signum: int, _frame: Any) -> None:
    raise Stopped(signum)


def tune_job(folder: str) -> str:
    """What the tune job runs on its node (submitit pickles this call): compose as the login node
    did, in its working directory, and tune here. scancel's TERM (or the time limit's) stops the
    trial under way, its engine's processes with it."""
    import signal

    from batchinfer.config.compose import compose
    from batchinfer.logs import setup_logging

    setup_logging()
    signal.signal(signal.SIGTERM, _stop)  # submitit's own handler would ignore it
    job = read_record(Path(folder))
    if job is None:
        raise RunDirError(f"{folder}: no {folder}/job.json; the tune folder was removed or moved")
    req = job.request
    try:
        os.chdir(req["cwd"])
    except OSError as e:
        raise RunDirError(f"the login node's working directory {req['cwd']} is not on this node ({e})") from None
    cfg = compose(req["overrides"], config_dir=req["config_dir"])
    result = tune(cfg, Options(**req["options"]))
    print(format_result(result))
    log.info("tune: finished; the table is in %s/tune.md", folder)
    return str(result["best"]["name"])
