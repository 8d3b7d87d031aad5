"""Judging a lock's recorded holder: may it still write? A lock is free only when its holder is
provably dead:

- on this machine (same host name, boot and pid namespace) by its pid: no such process, or the
  pid now names another process (its start, in ticks since boot, differs);
- a process of our own Slurm job (two processes of one salloc, `srun -n2`, members of one task)
  only by that, or by an earlier restart count than ours (Slurm ended that run before requeueing
  the job); a live one is never taken over;
- another Slurm job by `squeue`, asked on the holder's cluster (`-M`) when that is not ours:
  alive states refuse, "Invalid job id" or no line = dead;
- a holder Slurm did not answer for is refused and the lock kept, never stolen; a non-Slurm
  holder on another host cannot be judged and is refused."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from batchinfer import slurm_env, slurm_states
from batchinfer.errors import RunDirError, TransientRunDirError
from batchinfer.locks.holder import Holder, Judgement, Verdict, boot_id, pid_namespace, pid_start

# squeue is asked with this timeout; no answer in time = the holder cannot be judged.
SQUEUE_TIMEOUT_S = 30.0


def _default_cluster(timeout: float) -> Optional[str]:
    """The cluster Slurm's commands ask by default here (outside a job), or None if unknown."""
    try:
        out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "ClusterName":
            return value.strip() or None
    return None


def _squeue_state(job: str, timeout: float, cluster: Optional[str] = None) -> Judgement:
    """Judge a Slurm job by squeue (on the given cluster with -M, else the default one)."""
    where = ["-M", cluster] if cluster else []
    try:
        out = subprocess.run(
            ["squeue", *where, "-h", "-j", str(job), "-o", "%T"], capture_output=True, text=True, timeout=timeout
        )
    except FileNotFoundError:
        return Judgement(Verdict.UNKNOWN, "squeue is not installed here", True)
    except subprocess.TimeoutExpired:
        return Judgement(Verdict.UNKNOWN, f"squeue did not answer within {timeout:g} s", True)
    except OSError as e:
        return Judgement(Verdict.UNKNOWN, f"squeue could not run ({e})", True)
    on = f" on cluster {cluster}" if cluster else ""
    if "Invalid job id" in out.stderr:
        return Judgement(Verdict.DEAD, f"Slurm{on} no longer knows the job")  # purged after MinJobAge
    if out.returncode != 0:
        failed = (out.stderr.strip() or f"exit {out.returncode}")[:200]
        return Judgement(Verdict.UNKNOWN, f"squeue{on} failed: {failed}", True)
    # With -M, squeue may head its answer with "CLUSTER: name".
    states = [s for s in out.stdout.split() if s != "CLUSTER:" and s != cluster]
    if not states:
        return Judgement(Verdict.DEAD, f"the job is no longer queued{on}")
    alive = [s for s in states if s in slurm_states.ALIVE]  # its processes may still write
    return (
        Judgement(Verdict.ALIVE, f"Slurm{on}: {alive[0]}")
        if alive
        else Judgement(Verdict.DEAD, f"Slurm{on}: {states[0]}")
    )


def _slurm_state(holder: Holder, me: slurm_env.SlurmEnv) -> Judgement:
    """Judge another Slurm job's holder, asking the cluster it ran on: job ids are per cluster,
    and the default cluster answers "Invalid job id" for a live job of another one."""
    assert holder.slurm_job is not None
    cluster = holder.slurm_cluster
    if cluster and cluster != (me.cluster or _default_cluster(SQUEUE_TIMEOUT_S)):
        return _squeue_state(holder.slurm_job, SQUEUE_TIMEOUT_S, cluster)
    return _squeue_state(holder.slurm_job, SQUEUE_TIMEOUT_S)


def same_machine(holder: Holder) -> bool:
    """Whether the holder ran on this machine, in this boot (the same host name on two machines
    happens with containers; a different boot id is then another machine, or a reboot)."""
    if holder.host != socket.gethostname():
        return False
    boot = boot_id()
    return holder.boot_id is None or boot is None or holder.boot_id == boot


def _judge_locally(holder: Holder) -> Optional[Judgement]:
    """The holder judged by its pid when it ran on this machine in this pid namespace; None when
    its pid means nothing here."""
    if not holder.pid or not same_machine(holder):
        return None
    if holder.pid_ns is None:
        if holder.slurm_job:
            return None  # an older batchinfer's record: judged by Slurm, as that version did
    elif holder.pid_ns != pid_namespace():
        return None  # another container's pids
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return Judgement(Verdict.DEAD, "no such process")
    except PermissionError:
        pass  # someone else's live process
    started = pid_start(holder.pid)
    if holder.pid_start is not None and started is not None and started != holder.pid_start:
        return Judgement(Verdict.DEAD, f"pid {holder.pid} is now another process, started after the holder")
    return Judgement(Verdict.ALIVE, "process running")


def _same_job(holder: Holder, me: slurm_env.SlurmEnv) -> bool:
    if not holder.slurm_job or holder.slurm_job != me.job:
        return False
    return not (holder.slurm_cluster and me.cluster and holder.slurm_cluster != me.cluster)


def _judge_own_job(holder: Holder, me: slurm_env.SlurmEnv) -> Judgement:
    """A holder of our own Slurm job on another machine: alive (Slurm shows our job running)
    unless its run is an earlier one than ours."""
    if holder.slurm_restart is None:
        return Judgement(
            Verdict.UNKNOWN,
            "a process of this same Slurm job; its record, from an older batchinfer, has no restart count",
        )
    if holder.slurm_restart < me.restart_count:
        return Judgement(
            Verdict.DEAD,
            f"an earlier run of this Slurm job (restart {holder.slurm_restart}, this is restart "
            f"{me.restart_count}): Slurm ended it before requeueing",
        )
    return Judgement(Verdict.ALIVE, f"a live process of this same Slurm job and run (restart {holder.slurm_restart})")


def judge_holder(holder: Holder) -> Judgement:
    """Whether a lock's recorded holder may still write; a lock is free only when it is DEAD."""
    local = _judge_locally(holder)
    if local is not None:
        return local
    me = slurm_env.current()
    if _same_job(holder, me):
        return _judge_own_job(holder, me)
    if holder.slurm_job:
        return _slurm_state(holder, me)
    return Judgement(Verdict.UNKNOWN, "on another host without a Slurm job")


def refusal(
    refuse: Callable[[str], RunDirError], holder: Holder, judged: Judgement, path: Path, note: str = ""
) -> RunDirError:
    """The refusal that keeps a holder's lock (verdict ALIVE or UNKNOWN)."""
    who = holder.describe() + note
    if judged.verdict is Verdict.ALIVE:
        return refuse(f"{who} ({judged.why})")
    if judged.slurm_silent:
        e = refuse(f"{who}; Slurm did not answer ({judged.why}), so the lock is kept, never stolen: try again later")
        return TransientRunDirError(*e.args)  # retried by the shard loop
    return refuse(
        f"{who} ({judged.why}: it cannot be checked from here); if that process is gone, remove {path} by hand"
    )
