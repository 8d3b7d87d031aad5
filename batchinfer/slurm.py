"""Talking to Slurm: submitit executors, job states, MaxArraySize, requeueing this job."""

from __future__ import annotations

import logging
import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any, Optional

from batchinfer.errors import ConfigError
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


def _run(cmd: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise ConfigError(f"{cmd[0]} not found: Slurm's client commands must be on PATH (and SLURM_CONF set)") from None


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


def check_gpus(cfg: dict[str, Any]) -> None:
    """gpus_per_task must cover tensor x pipeline parallelism (0: a CPU partition)."""
    need = cfg["model"]["tensor_parallel_size"] * cfg["model"]["pipeline_parallel_size"]
    have = cfg["cluster"]["gpus_per_task"]
    if have and have < need:
        raise ConfigError(
            f"cluster.gpus_per_task={have} is less than model.tensor_parallel_size x pipeline_parallel_size = {need}; "
            f"set cluster.gpus_per_task={need}"
        )


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


def check_log_folder(folder: Path) -> None:
    """Slurm cannot take every path: an #SBATCH line ends at a newline, and % starts a filename pattern."""
    for char, why in (("\n", "a newline"), ("%", "a % (Slurm reads %j, %A... in log paths)")):
        if char in str(folder):
            raise ConfigError(
                f"output.dir {str(folder.parent.parent)!r} contains {why}, which Slurm cannot take in "
                f"the log paths of its jobs; choose an output.dir without it"
            )


def array_parameters(cluster: dict[str, Any], n_tasks: int) -> dict[str, Any]:
    """submitit SlurmExecutor parameters of a worker array."""
    params: dict[str, Any] = {
        "time": cluster["time"],
        "signal_delay_s": cluster["signal_lead_s"],
        "array_parallelism": min(cluster["array_parallelism"], max(n_tasks, 1)),
        "setup": [*cluster["setup"], *env_lines(cluster["env"])],
        "additional_parameters": {"requeue": True, **export_option(cluster["sbatch_extra"] or {}, cluster["env"])},
    }
    for key in ("partition", "account", "qos", "cpus_per_task", "mem", "constraint"):
        if cluster.get(key) is not None:
            params[key] = cluster[key]
    if cluster["gpus_per_task"]:
        params["gpus_per_task"] = cluster["gpus_per_task"]
    return params


def merge_parameters(cluster: dict[str, Any], after: list[str]) -> dict[str, Any]:
    """The merge job: no GPU, one CPU, after every array ends however it ends (afterany)."""
    params: dict[str, Any] = {
        "time": 60,
        "cpus_per_task": 1,
        "setup": [*cluster["setup"], *env_lines(cluster["env"])],
        "dependency": "afterany:" + ":".join(after),
    }
    for key in ("partition", "account", "qos"):
        if cluster.get(key) is not None:
            params[key] = cluster[key]
    return params


def executor(folder: Path, params: dict[str, Any]) -> Any:
    """A submitit SlurmExecutor writing its scripts and logs under folder."""
    import submitit

    ex = submitit.SlurmExecutor(folder=folder)
    ex.update_parameters(**params)
    return ex


def job_states(job_ids: list[str]) -> dict[str, str]:
    """State of each array task / job: squeue for live ones, sacct for finished ones."""
    if not job_ids:
        return {}
    states: dict[str, str] = {}
    res = _run(["sacct", "-n", "-P", "-X", "-o", "JobID,State", "-j", ",".join(job_ids)])
    if res.returncode == 0:
        for line in res.stdout.splitlines():
            jid, _, state = line.partition("|")
            if jid and "[" not in jid:
                states[jid] = state.split()[0] if state else ""
    # squeue -j fails outright if one id has left slurmctld's memory: list this user's jobs instead.
    res = _run(["squeue", "-h", "-r", "--me", "-o", "%i|%A|%T"])
    if res.returncode == 0:
        wanted = set(job_ids)
        for line in res.stdout.splitlines():
            jid, _, rest = line.partition("|")
            array_or_job, _, state = rest.partition("|")
            jid = jid.strip()
            if jid in wanted or jid.split("_")[0] in wanted or array_or_job in wanted:
                states[jid] = state.strip()
    return states


def cancel(job_ids: list[str]) -> None:
    """scancel the given jobs (finished ones are ignored by Slurm)."""
    if job_ids:
        _run(["scancel", *job_ids])


def this_job() -> Optional[str]:
    """This array task's id (ARRAYJOB_TASK) or job id, when running under Slurm."""
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    if array and os.environ.get("SLURM_ARRAY_TASK_ID"):
        return f"{array}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ.get("SLURM_JOB_ID")


def requeue_self() -> bool:
    """`scontrol requeue` this job: Slurm does not retry a non-zero exit by itself."""
    job = this_job()
    if not job:
        return False
    res = _run(["scontrol", "requeue", job])
    if res.returncode != 0:
        log.error("scontrol requeue %s failed: %s", job, res.stderr.strip())
        return False
    log.warning("requeued %s", job)
    return True
