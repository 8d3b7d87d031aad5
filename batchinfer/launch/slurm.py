"""Talking to Slurm: its commands under a timeout, the sbatch parameters of a submission, job
states from sacct (read by sacct.py) and squeue, MaxArraySize, cancelling, requeueing this task."""

from __future__ import annotations

import getpass
import logging
import re
import shlex
import subprocess
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Optional, TypedDict

from batchinfer import slurm_env
from batchinfer.config.schema import ClusterConfig, Config
from batchinfer.errors import ConfigError, RequeueFailed, SlurmUnavailable
from batchinfer.launch.sacct import SACCT_FIELDS, read_sacct, task_endings
from batchinfer.redaction import ENV_REF, is_secret_entry, redact_text, shell_refs
from batchinfer.security import export_option

log = logging.getLogger("batchinfer")

# A healthy slurmctld answers in seconds; a hung one must not hang status, resume or a worker.
TIMEOUT_S = 60.0


def run_command(cmd: list[str], timeout: Optional[float] = None) -> subprocess.CompletedProcess:
    """Run a Slurm command (TIMEOUT_S unless told): ConfigError if it is not installed,
    SlurmUnavailable if it does not answer in time."""
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
    res = run_command(["scontrol", "show", "config"])
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
    Returns the engines per task. With cluster.nodes_per_task > 1, TP x PP spans the nodes instead."""
    from batchinfer.config.engines import engines_per_task
    from batchinfer.config.nodes import check_nodes

    if check_nodes(cfg) > 1:
        return 1

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


def env_lines(env: Mapping[str, Optional[str]]) -> list[str]:
    """`export K=V` lines, values quoted so no config value reaches the shell unquoted.

    Secrets get no line: the sbatch script lands in DIR/logs, so they travel in the environment of
    the sbatch call instead (security.submission_env); a value referring to a secret variable
    (`${oc.env:NAME}`, or a secret's value, which redaction turns into one) reads it in the task."""
    lines = []
    for k, v in env.items():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(k)):
            raise ConfigError(f"cluster.env: {k!r} is not a valid environment variable name")
        if v is None:
            lines.append(f"unset {k}")
        elif not is_secret_entry(k, v):
            lines.append(f"export {k}={shell_word(redact_text(str(v)))}")
    return lines


def shell_word(value: str) -> str:
    """value quoted for the shell, its `${oc.env:NAME}` references left to the shell as "${NAME}"."""
    if not ENV_REF.search(value):
        return shlex.quote(value)
    out, pos = [], 0
    for m in ENV_REF.finditer(value):
        out += [re.sub(r'([\\"$`])', r"\\\1", value[pos : m.start()]), "${" + m.group(1) + "}"]
        pos = m.end()
    out.append(re.sub(r'([\\"$`])', r"\\\1", value[pos:]))
    return '"' + "".join(out) + '"'


def setup_lines(cluster: ClusterConfig) -> list[str]:
    """cluster.setup, then cluster.env's exports: a secret is read from the task's environment."""
    return [shell_refs(redact_text(line)) for line in cluster.setup] + env_lines(cluster.env)


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


class SlurmParameters(TypedDict, total=False):
    """submitit SlurmExecutor parameters (by submitit's names) of an array or the merge job."""

    time: int
    signal_delay_s: int
    array_parallelism: int
    setup: list[str]
    additional_parameters: dict[str, Any]  # sbatch options without a parameter of submitit's (sbatch_extra)
    dependency: str
    partition: str
    account: str
    qos: str
    cpus_per_task: int
    mem: str
    constraint: str
    gpus_per_task: int
    nodes: int
    ntasks_per_node: int
    srun_args: list[str]
    job_name: str


def array_parameters(cluster: ClusterConfig, n_tasks: int) -> SlurmParameters:
    """submitit SlurmExecutor parameters of a worker array."""
    params: SlurmParameters = {
        "time": cluster.time,
        "signal_delay_s": cluster.signal_lead_s,
        "array_parallelism": min(cluster.array_parallelism, max(n_tasks, 1)),
        "setup": setup_lines(cluster),
        "additional_parameters": {
            "requeue": True,
            **export_option(cluster.sbatch_extra or {}, cluster.env, cluster.env_inherit),
        },
    }
    for key in ("partition", "account", "qos", "cpus_per_task", "mem", "constraint"):
        if getattr(cluster, key) is not None:
            params[key] = getattr(cluster, key)  # type: ignore[literal-required]
    if cluster.gpus_per_task:
        params["gpus_per_task"] = cluster.gpus_per_task
    if cluster.nodes_per_task > 1:
        # One task per node; submitit's own step runs the worker on the first node alone, and the
        # worker starts the other nodes' engine ranks as a step of its own (launch/ranks.py).
        params.update(nodes=cluster.nodes_per_task, ntasks_per_node=1, srun_args=["--nodes=1", "--ntasks=1"])
    return params


def merge_parameters(cluster: ClusterConfig, after: list[str]) -> SlurmParameters:
    """The merge job: no GPU, cluster.merge_time/merge_mem/merge_cpus, after every array ends
    however it ends (afterany)."""
    params: SlurmParameters = {
        "time": cluster.merge_time,
        "cpus_per_task": cluster.merge_cpus,
        "setup": setup_lines(cluster),
        "dependency": "afterany:" + ":".join(after),
    }
    if cluster.merge_mem is not None:
        params["mem"] = cluster.merge_mem
    for key in ("partition", "account", "qos"):
        if getattr(cluster, key) is not None:
            params[key] = getattr(cluster, key)  # type: ignore[literal-required]
    return params


def tasks_killed_by_usr2(arrays: list[str], tasks: list[str], wait_s: float = 60.0) -> set[str]:
    """Those of tasks (of these arrays) whose last run was killed by USR2; sacct is asked again
    (up to wait_s) while one of them has no final state yet: the dependency that starts the merge
    job fires before slurmdbd has every record. Empty if sacct cannot say."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            res = run_command(["sacct", "-n", "-P", "-o", "JobID,State,ExitCode", "-j", ",".join(arrays)])
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


def job_states(
    job_ids: list[str],
    names: Iterable[str] = (),
    problems: Optional[list[str]] = None,
    nodes: Optional[dict[str, str]] = None,
) -> dict[str, str]:
    """State of each array task / job: squeue for live ones, sacct for finished ones.

    Ids may be array job ids, plain job ids or array task ids (A_T): sacct is asked about the
    array ids (A) and answers with every task's line, so 10,000 tasks cost one short argument,
    not one id each. Jobs of this user named in `names` are included too (a submission whose ids
    were never recorded). With a `problems` list, a Slurm command that fails or does not answer
    is noted there and the states known without it are returned; without one, a timeout raises.
    A `nodes` dict gets each task's nodes as sacct lists them (`node[1-2]`), for tasks that have some."""
    names = set(names)
    if not job_ids and not names:
        return {}
    arrays = sorted({j.split("_")[0] for j in job_ids})
    states: dict[str, str] = {}

    def call(cmd: list[str]) -> Optional[str]:
        try:
            res = run_command(cmd)
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

    out = call(["sacct", "-n", "-P", "-X", "-o", SACCT_FIELDS, "-j", ",".join(arrays)]) if arrays else None
    tasks = read_sacct(out or "")
    states.update({task: t.state for task, t in tasks.items() if t.state is not None})
    if nodes is not None:
        nodes.update({task: t.nodes for task, t in tasks.items() if t.nodes})
    # squeue -j fails outright if one id has left slurmctld's memory: list this user's jobs instead.
    out = call(["squeue", "-h", "-r", "--me", "-o", "%i|%A|%T|%j"])
    wanted = set(arrays)
    for line in (out or "").splitlines():
        jid, array_or_job, state, name = (line.split("|", 3) + ["", "", ""])[:4]
        jid = jid.strip()
        if jid in wanted or jid.split("_")[0] in wanted or array_or_job in wanted or name.strip() in names:
            states[jid] = state.strip()
    return states


# What a recorded Slurm job id or job name may be: anything else (`--user=root`, `1,2`, a space)
# would reach scancel, squeue or sacct as an option or a list, whoever wrote it into DIR.
JOB_ID = re.compile(r"[0-9]+(_[0-9]+)?")
JOB_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+:@-]*")


def is_job_id(value: object) -> bool:
    """Whether value is a Slurm job id (`123`) or an array task's (`123_4`)."""
    return isinstance(value, (str, int)) and not isinstance(value, bool) and bool(JOB_ID.fullmatch(str(value)))


def is_job_name(value: object) -> bool:
    """Whether value is a job name batchinfer gives (no option, no list, no space)."""
    return isinstance(value, str) and bool(JOB_NAME.fullmatch(value))


# scancel --verbose's line for a job it did not signal (finished, or unknown to Slurm); without
# --verbose scancel says nothing about them and exits 0.
NOT_CANCELLED = re.compile(r"Kill job error on job id (\S+): (.+)")


def cancel(job_ids: list[str], names: Iterable[str] = ()) -> dict[str, str]:
    """scancel the given jobs, and this user's jobs of the given names; the ids scancel did not
    act on (already finished, unknown to Slurm), with its reason."""
    names = list(names)
    bad = [repr(j) for j in job_ids if not is_job_id(j)] + [repr(n) for n in names if not is_job_name(n)]
    if bad:  # the readers drop them (launch/jobs.py): this is the last guard before scancel
        raise ConfigError(f"not a Slurm job id or job name: {', '.join(bad)}; nothing was cancelled")
    not_cancelled: dict[str, str] = {}
    if job_ids:
        res = run_command(["scancel", "--verbose", *job_ids])
        not_cancelled = {m.group(1): m.group(2).strip() for m in NOT_CANCELLED.finditer(res.stderr or "")}
        if res.returncode != 0 and not not_cancelled:
            reason = first_error_line(res.stderr or "")
            not_cancelled = {j: reason for j in job_ids}
    for name in names:
        # scancel ANDs its filters, so jobs found by name get a call of their own
        run_command(["scancel", f"--name={name}", f"--user={getpass.getuser()}"])
    return not_cancelled


def this_job() -> Optional[str]:
    """This array task's id (ARRAYJOB_TASK) or job id, when running under Slurm."""
    return slurm_env.current().job


def requeue_task() -> None:
    """`scontrol requeue` this task (Slurm does not retry a non-zero exit by itself), or raise
    RequeueFailed naming the task and scontrol's message."""
    job = this_job()
    if not job:
        raise RequeueFailed("cannot requeue: not running as a Slurm job (no SLURM_JOB_ID)")
    try:
        res = run_command(["scontrol", "requeue", job])
    except SlurmUnavailable as e:
        raise RequeueFailed(f"scontrol requeue {job} failed: {e.reason}") from None
    if res.returncode != 0:
        raise RequeueFailed(f"scontrol requeue {job} failed: {first_error_line(res.stderr or res.stdout)}")
    log.warning("requeued %s", job)
