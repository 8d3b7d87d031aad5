"""Talking to Slurm: submitit executors, job states, MaxArraySize, requeueing this job."""

from __future__ import annotations

import functools
import getpass
import logging
import re
import shlex
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional

from batchinfer import slurm_env
from batchinfer.config.schema import ClusterConfig, Config
from batchinfer.errors import ConfigError, RequeueFailed, SlurmUnavailable
from batchinfer.security import export_option, is_secret_name

log = logging.getLogger("batchinfer")
ACTIVE_STATES = {
    "PENDING",
    "RUNNING",
    "REQUEUED",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "CONFIGURING",
    "COMPLETING",
    "RESIZING",
    "SUSPENDED",
}
FAILED_STATES = {"FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "CANCELLED", "PREEMPTED"}


# A healthy slurmctld answers in seconds; a hung one must not hang status, resume or a worker.
TIMEOUT_S = 60.0
# sbatch waits for slurmctld to accept the job (and retries busy answers itself): allow longer.
SBATCH_TIMEOUT_S = 120.0


def _run(cmd: list[str], timeout: Optional[float] = None) -> subprocess.CompletedProcess:
    limit = TIMEOUT_S if timeout is None else timeout
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
    except FileNotFoundError:
        raise ConfigError(f"{cmd[0]} not found: Slurm's client commands must be on PATH (and SLURM_CONF set)") from None
    except subprocess.TimeoutExpired:
        raise SlurmUnavailable(cmd[0], f"timed out after {limit:g} s") from None


def first_error_line(text: str) -> str:
    """The lines of a Slurm command's stderr that say what went wrong, as one line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    return "; ".join(errors or lines[-1:]) or "no message"


def max_array_size() -> int:
    """The cluster's MaxArraySize (array indices must stay below it)."""
    res = _run(["scontrol", "show", "config"])
    if res.returncode != 0:
        raise ConfigError(f"cannot reach Slurm (scontrol show config): {res.stderr.strip()}")
    m = re.search(r"^MaxArraySize\s*=\s*(\d+)", res.stdout, re.M)
    return int(m.group(1)) if m else 1001


def split_tasks(tasks: list[Any], limit: int) -> list[list[Any]]:
    """Chunks of at most `limit` array tasks (one array each)."""
    return [tasks[i : i + limit] for i in range(0, len(tasks), limit)] or [[]]


def check_gpus(cfg: Config) -> int:
    """gpus_per_task must cover tensor x pipeline parallelism (0: a CPU partition) times
    cluster.engines_per_task; on a CPU partition each engine needs a core of cluster.cpus_per_task.
    Returns the engines per task."""
    from batchinfer.config.engines import engines_per_task

    need = cfg.model.tensor_parallel_size * cfg.model.pipeline_parallel_size
    have = cfg.cluster.gpus_per_task
    if have and have < need:
        raise ConfigError(
            f"cluster.gpus_per_task={have} is less than model.tensor_parallel_size x pipeline_parallel_size = {need}; "
            f"set cluster.gpus_per_task={need}"
        )
    n = engines_per_task(cfg)  # refuses N x TP x PP > gpus_per_task, naming the settings
    cpus = cfg.cluster.cpus_per_task
    if not have and cpus is not None and n > cpus:
        raise ConfigError(
            f"cluster.engines_per_task={n} on a CPU partition (cluster.gpus_per_task=0) needs a core per engine, "
            f"but cluster.cpus_per_task={cpus}; raise cluster.cpus_per_task to {n} or more, or lower "
            f"cluster.engines_per_task to {cpus}"
        )
    return n


def env_lines(env: dict[str, Any]) -> list[str]:
    """`export K=V` lines, values quoted so no config value reaches the shell unquoted.

    Secret-named variables get no line: the sbatch script lands in DIR/logs, so they travel in
    the environment of the sbatch call instead (security.submission_env)."""
    lines = []
    for k, v in env.items():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(k)):
            raise ConfigError(f"cluster.env: {k!r} is not a valid environment variable name")
        if v is None:
            lines.append(f"unset {k}")
        elif not is_secret_name(k):
            lines.append(f"export {k}={shlex.quote(str(v))}")
    return lines


# Values that become `#SBATCH --key=value` lines: a line break would end the block early (the
# directives after it, --requeue and --signal among them, are then ignored) and start a shell line.
DIRECTIVE_KEYS = ("partition", "account", "qos", "mem", "constraint", "merge_mem")


def check_directives(cluster: ClusterConfig) -> None:
    """ConfigError naming the key where a value for an #SBATCH line holds a newline, CR or NUL."""
    values = [(f"cluster.{k}", getattr(cluster, k)) for k in DIRECTIVE_KEYS]
    for k, v in (cluster.sbatch_extra or {}).items():
        values += [("cluster.sbatch_extra (a key)", k), (f"cluster.sbatch_extra.{k}", v)]
    for key, value in values:
        bad = [
            name
            for char, name in (("\n", "a newline"), ("\r", "a carriage return"), ("\0", "a NUL"))
            if char in str(value or "")
        ]
        if bad:
            raise ConfigError(
                f"{key}={str(value)!r} contains {bad[0]}, which would end sbatch's #SBATCH lines early "
                "and run the rest as a shell command; remove it"
            )


def check_log_folder(folder: Path) -> None:
    """Slurm cannot take every path: an #SBATCH line ends at a newline, and % starts a filename pattern."""
    for char, why in (("\n", "a newline"), ("%", "a % (Slurm reads %j, %A... in log paths)")):
        if char in str(folder):
            raise ConfigError(
                f"output.dir {str(folder.parent.parent)!r} contains {why}, which Slurm cannot take in "
                f"the log paths of its jobs; choose an output.dir without it"
            )


def array_parameters(cluster: ClusterConfig, n_tasks: int) -> dict[str, Any]:
    """submitit SlurmExecutor parameters of a worker array."""
    params: dict[str, Any] = {
        "time": cluster.time,
        "signal_delay_s": cluster.signal_lead_s,
        "array_parallelism": min(cluster.array_parallelism, max(n_tasks, 1)),
        "setup": [*cluster.setup, *env_lines(cluster.env)],
        "additional_parameters": {"requeue": True, **export_option(cluster.sbatch_extra or {}, cluster.env)},
    }
    for key in ("partition", "account", "qos", "cpus_per_task", "mem", "constraint"):
        if getattr(cluster, key) is not None:
            params[key] = getattr(cluster, key)
    if cluster.gpus_per_task:
        params["gpus_per_task"] = cluster.gpus_per_task
    return params


def merge_parameters(cluster: ClusterConfig, after: list[str]) -> dict[str, Any]:
    """The merge job: no GPU, cluster.merge_time/merge_mem/merge_cpus, after every array ends
    however it ends (afterany)."""
    params: dict[str, Any] = {
        "time": cluster.merge_time,
        "cpus_per_task": cluster.merge_cpus,
        "setup": [*cluster.setup, *env_lines(cluster.env)],
        "dependency": "afterany:" + ":".join(after),
    }
    if cluster.merge_mem is not None:
        params["mem"] = cluster.merge_mem
    for key in ("partition", "account", "qos"):
        if getattr(cluster, key) is not None:
            params[key] = getattr(cluster, key)
    return params


# The step's Python blocks USR2 as its first statement, then runs submitit's entry point: a
# preemption notice while the interpreter loads submitit and unpickles the task stays pending for
# the worker instead of killing the task by USR2's default action (or meeting submitit's handler).
# Only the interpreter's own start-up is left uncovered (`heal` resubmits a task killed there).
STEP_BOOT = (
    "import signal, sys, runpy; signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2}); "
    "i = sys.argv.index('-m'); module = sys.argv[i + 1]; sys.argv = [sys.argv[0], *sys.argv[i + 2:]]; "
    "runpy.run_module(module, run_name='__main__', alter_sys=True)"
)


def step_python() -> str:
    """submitit's `python`: it appends `-u -m submitit.core._submit FOLDER`, which STEP_BOOT runs."""
    return f"{shlex.quote(sys.executable)} -u -c {shlex.quote(STEP_BOOT)}"


def executor(folder: Path, params: dict[str, Any]) -> Any:
    """A submitit SlurmExecutor writing its scripts and logs under folder, its sbatch under a timeout."""
    ex = _timed_executor_class()(folder=folder, python=step_python())
    ex.update_parameters(**params)
    return ex


@functools.cache
def _timed_executor_class() -> type:
    """submitit's SlurmExecutor with sbatch run under SBATCH_TIMEOUT_S (submitit sets none).

    sbatch refusing raises CalledProcessError carrying sbatch's stderr; submitit's own runner
    would also print that stderr, and launch says it in one line instead."""
    import submitit
    import submitit.slurm.slurm as submitit_slurm
    from submitit.core import utils

    class TimedSlurmExecutor(submitit.SlurmExecutor):
        def _internal_process_submissions(self, delayed_submissions: list[Any]) -> list[Any]:
            if len(delayed_submissions) == 1:
                return super()._internal_process_submissions(delayed_submissions)
            # submitit submits an array through a fresh executor made by the module-level name
            # SlurmExecutor: point that name here for the call, so the array's sbatch is timed too.
            plain = submitit_slurm.SlurmExecutor
            submitit_slurm.SlurmExecutor = TimedSlurmExecutor
            try:
                return super()._internal_process_submissions(delayed_submissions)
            finally:
                submitit_slurm.SlurmExecutor = plain

        def _submit_command(self, command: str) -> Any:
            # submitit 1.5's _submit_command, with sbatch run by subprocess.run under a timeout.
            tmp_uuid = uuid.uuid4().hex
            folder = utils.JobPaths.get_first_id_independent_folder(self.folder)
            submission_file_path = folder / f".submission_file_{tmp_uuid}.sh"
            with submission_file_path.open("w") as f:
                f.write(self._make_submission_file_text(command, tmp_uuid))
            cmd = self._make_submission_command(submission_file_path)
            res = _run(cmd, timeout=SBATCH_TIMEOUT_S)
            if res.returncode != 0:
                raise subprocess.CalledProcessError(res.returncode, cmd, res.stdout, res.stderr)
            job_id = self._get_job_id_from_submission_command(res.stdout)
            job = self.job_class(folder=self.folder, job_id=job_id, tasks=list(range(self._num_tasks())))
            job.paths.move_temporary_file(submission_file_path, "submission_file", keep_as_symlink=True)
            self._write_job_id(job.job_id, tmp_uuid)
            self._set_job_permissions(job.paths.folder)
            return job

    return TimedSlurmExecutor


def array_indices(spec: str) -> list[int]:
    """The task indices of an array range as sacct and squeue print it: `[3-9]`, `[1,4-8:2%2]`."""
    out: list[int] = []
    for item in spec.strip("[]").split("%")[0].split(","):
        bounds, _, step = item.partition(":")
        first, _, last = bounds.partition("-")
        try:
            out += range(int(first), int(last or first) + 1, int(step or 1))
        except ValueError:
            continue  # a form this version does not know: those tasks keep the state squeue gives
    return out


def sacct_states(text: str) -> dict[str, str]:
    """`sacct -n -P -X -o JobID,State` output as {job or A_T: state}, pending ranges expanded.

    A range line (`A_[3-9%2]`: tasks not started yet) never overrides a task's own line; of two
    lines for one task (a requeued task's runs, with -D) the later one wins."""
    own: dict[str, str] = {}
    ranged: dict[str, str] = {}
    for line in text.splitlines():
        jid, _, state = line.strip().partition("|")
        state = state.split()[0] if state.strip() else ""  # "CANCELLED by 1000"
        array, _, index = jid.partition("_")
        if index.startswith("["):
            for i in array_indices(index):
                ranged[f"{array}_{i}"] = state
        elif jid:
            own[jid] = state
    return {**ranged, **own}


USR2_NUMBER = "12"  # SIGUSR2 on Linux, as sacct prints it in ExitCode
FINAL_STATES = FAILED_STATES | {"COMPLETED", "OUT_OF_MEMORY"}


def task_endings(text: str) -> dict[str, str]:
    """{task: how its last run ended} from `sacct -n -P -o JobID,State,ExitCode` (steps included):
    "usr2" when killed by USR2 (a line of the task with signal 12 in its ExitCode, `0:12`: its
    batch shell or step; or the task FAILED with exit code 12, srun passing on its task's death),
    "ended" for another end, "running" while the task has no final state (or accounting lags).
    Tasks are A_T, or a plain job id (a submission of one task is a plain job)."""
    final: dict[str, bool] = {}  # task -> its own line (not a step's) is in a final state
    killed: set[str] = set()
    for line in text.splitlines():
        jid, state, code = (line.strip().split("|") + ["", ""])[:3]
        task, _, step = jid.partition(".")
        if "[" in task or not task:
            continue
        status, _, sig = code.partition(":")
        state = state.split()[0] if state.strip() else ""
        if sig == USR2_NUMBER or (not step and state == "FAILED" and status == USR2_NUMBER):
            killed.add(task)
        if not step:
            final[task] = state in FINAL_STATES
        else:
            final.setdefault(task, False)
    # The task's own line decides whether it ended: a step killed by USR2 in a task still running
    # (or queued again) is no death to heal.
    return {t: ("usr2" if t in killed else "ended") if done else "running" for t, done in final.items()}


def usr2_deaths(text: str) -> set[str]:
    """Tasks that sacct's lines show killed by USR2 (task_endings)."""
    return {task for task, how in task_endings(text).items() if how == "usr2"}


def tasks_killed_by_usr2(arrays: list[str], tasks: list[str], wait_s: float = 60.0) -> set[str]:
    """Those of tasks (of these arrays) whose last run was killed by USR2; sacct is asked again
    (up to wait_s) while one of them has no final state yet: the dependency that starts the merge
    job fires before slurmdbd has every record. Empty if sacct cannot say."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            res = _run(["sacct", "-n", "-P", "-o", "JobID,State,ExitCode", "-j", ",".join(arrays)])
        except (SlurmUnavailable, ConfigError) as e:
            log.warning("cannot ask sacct how the tasks ended: %s", e)
            return set()
        if res.returncode != 0:
            log.warning("sacct: %s", first_error_line(res.stderr))
            return set()
        endings = task_endings(res.stdout)
        if all(endings.get(t, "running") != "running" for t in tasks) or time.monotonic() > deadline:
            return {t for t in tasks if endings.get(t) == "usr2"}
        time.sleep(5)


def job_states(job_ids: list[str], names: Iterable[str] = (), problems: Optional[list[str]] = None) -> dict[str, str]:
    """State of each array task / job: squeue for live ones, sacct for finished ones.

    Ids may be array job ids, plain job ids or array task ids (A_T): sacct is asked about the
    array ids (A) and answers with every task's line, so 10,000 tasks cost one short argument,
    not one id each. Jobs of this user named in `names` are included too (a submission whose ids
    were never recorded). With a `problems` list, a Slurm command that fails or does not answer
    is noted there and the states known without it are returned; without one, a timeout raises."""
    names = set(names)
    if not job_ids and not names:
        return {}
    arrays = sorted({j.split("_")[0] for j in job_ids})
    states: dict[str, str] = {}

    def call(cmd: list[str]) -> Optional[str]:
        try:
            res = _run(cmd)
        except SlurmUnavailable as e:
            if problems is None:
                raise
            problems.append(e.short)
            return None
        except ConfigError:  # not on PATH: a run directory copied off the cluster still has a status
            if problems is None:
                raise
            problems.append(f"{cmd[0]}: not found on PATH")
            return None
        if res.returncode != 0:
            # sacct fails where accounting is off: worth saying in status, not worth failing for
            if problems is not None:
                problems.append(f"{cmd[0]}: exit {res.returncode}: {first_error_line(res.stderr)}")
            return None
        return res.stdout

    out = call(["sacct", "-n", "-P", "-X", "-o", "JobID,State", "-j", ",".join(arrays)]) if arrays else None
    states.update(sacct_states(out or ""))
    # squeue -j fails outright if one id has left slurmctld's memory: list this user's jobs instead.
    out = call(["squeue", "-h", "-r", "--me", "-o", "%i|%A|%T|%j"])
    wanted = set(arrays)
    for line in (out or "").splitlines():
        jid, array_or_job, state, name = (line.split("|", 3) + ["", "", ""])[:4]
        jid = jid.strip()
        if jid in wanted or jid.split("_")[0] in wanted or array_or_job in wanted or name.strip() in names:
            states[jid] = state.strip()
    return states


def cancel(job_ids: list[str], names: Iterable[str] = ()) -> None:
    """scancel the given jobs, and this user's jobs of the given names (finished ones are ignored)."""
    if job_ids:
        _run(["scancel", *job_ids])
    for name in names:
        # scancel ANDs its filters, so jobs found by name get a call of their own
        _run(["scancel", f"--name={name}", f"--user={getpass.getuser()}"])


def this_job() -> Optional[str]:
    """This array task's id (ARRAYJOB_TASK) or job id, when running under Slurm."""
    return slurm_env.current().job


def requeue_self() -> bool:
    """`scontrol requeue` this job: Slurm does not retry a non-zero exit by itself. False if it failed."""
    if not this_job():
        return False
    try:
        requeue_this_job()
    except RequeueFailed as e:
        log.error("%s", e)
        return False
    return True


def requeue_this_job() -> None:
    """`scontrol requeue` this job, or raise RequeueFailed naming the job and scontrol's message."""
    job = this_job()
    if not job:
        raise RequeueFailed("cannot requeue: not running as a Slurm job (no SLURM_JOB_ID)")
    try:
        res = _run(["scontrol", "requeue", job])
    except SlurmUnavailable as e:
        raise RequeueFailed(f"scontrol requeue {job} failed: {e.reason}") from None
    if res.returncode != 0:
        raise RequeueFailed(f"scontrol requeue {job} failed: {first_error_line(res.stderr or res.stdout)}")
    log.warning("requeued %s", job)
