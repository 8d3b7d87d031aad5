"""Engines per array task: how many, and which GPUs (or CPU cores) each one gets.

A task with a whole node (cluster.gpus_per_task=8) runs N = cluster.engines_per_task engines,
each a worker process with its own vLLM engine on tensor x pipeline parallel size GPUs. `auto`
takes N from the GPUs the task has. On a CPU (no GPUs) the task's cores are split instead, and
each engine's OpenMP threads are bound to its own share through VLLM_CPU_OMP_THREADS_BIND."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from batchinfer.errors import ConfigError

AUTO = "auto"


def check_engines_value(value: Any) -> None:
    """cluster.engines_per_task takes a positive int or `auto`."""
    if value == AUTO:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"cluster.engines_per_task={value!r} is out of range: it takes an int >= 1 or auto")


def gpus_per_engine(cfg: Any) -> int:
    """GPUs one engine spans: tensor x pipeline parallel size."""
    return int(cfg.model.tensor_parallel_size) * int(cfg.model.pipeline_parallel_size)


def engines_per_task(cfg: Any, gpus: Optional[int] = None) -> int:
    """N for a task holding `gpus` GPUs (default cluster.gpus_per_task; 0: a CPU task).

    `auto` is gpus // (TP x PP), 1 without GPUs. A layout that needs more GPUs than the task has
    is refused, naming the settings."""
    value = cfg.cluster.engines_per_task
    check_engines_value(value)
    have = int(cfg.cluster.gpus_per_task if gpus is None else gpus)
    each = gpus_per_engine(cfg)
    if value == AUTO:
        return max(1, have // each) if have else 1
    n = int(value)
    if have and n * each > have:
        raise ConfigError(
            f"cluster.engines_per_task={n} x model.tensor_parallel_size x pipeline_parallel_size = {n * each} "
            f"GPUs, but the task has {have} (cluster.gpus_per_task={have}); lower cluster.engines_per_task "
            f"to {max(1, have // each)}, raise cluster.gpus_per_task to {n * each}, or use engines_per_task=auto"
        )
    return n


def visible_gpus(env: Optional[Mapping[str, str]] = None) -> list[str]:
    """The GPUs Slurm gave this task (CUDA_VISIBLE_DEVICES), in order; [] on a CPU node."""
    env = os.environ if env is None else env
    value = env.get("CUDA_VISIBLE_DEVICES", "").strip()
    if not value or value in ("-1", "NoDevFiles"):
        return []
    return [d.strip() for d in value.split(",") if d.strip()]


def engine_devices(env: Optional[Mapping[str, str]] = None) -> str:
    """What an engine with this environment runs on: its GPUs (`2,3`), `cpu:<cores>` or `cpu`."""
    env = os.environ if env is None else env
    gpus = visible_gpus(env)
    if gpus:
        return ",".join(gpus)
    cores = env.get("VLLM_CPU_OMP_THREADS_BIND", "")
    return f"cpu:{cores}" if cores and cores not in ("auto", "nobind") else "cpu"


def split_even(items: Sequence[Any], n: int) -> list[list[Any]]:
    """items cut into n consecutive groups whose sizes differ by at most one (leftovers go first)."""
    base, extra = divmod(len(items), n)
    out, start = [], 0
    for k in range(n):
        size = base + (1 if k < extra else 0)
        out.append(list(items[start : start + size]))
        start += size
    return out


def engine_envs(cfg: Any, n: int, gpus: Sequence[str], cpus: Sequence[int]) -> list[dict[str, str]]:
    """The environment each of n engines starts with: its own GPUs, or on a CPU node its own cores.

    GPUs: consecutive groups of TP x PP from the task's CUDA_VISIBLE_DEVICES (left-over GPUs stay
    idle). CPU: the task's cores split evenly; VLLM_CPU_OMP_THREADS_BIND pins the engine's OpenMP
    threads to them (vLLM's default, `auto`, binds every engine to the same NUMA node's cores)."""
    if gpus:
        each = gpus_per_engine(cfg)
        if n * each > len(gpus):
            raise ConfigError(
                f"cluster.engines_per_task={n} engines x {each} GPUs each need {n * each} GPUs; this task "
                f"sees {len(gpus)} (CUDA_VISIBLE_DEVICES={','.join(gpus)}); set cluster.gpus_per_task={n * each}"
            )
        return [{"CUDA_VISIBLE_DEVICES": ",".join(gpus[k * each : (k + 1) * each])} for k in range(n)]
    if len(cpus) < n:
        raise ConfigError(
            f"cluster.engines_per_task={n} on a CPU task needs at least {n} cores; this task has {len(cpus)} "
            f"({_ranges(cpus)}); raise cluster.cpus_per_task or lower cluster.engines_per_task"
        )
    return [{"VLLM_CPU_OMP_THREADS_BIND": _ranges(group)} for group in split_even(sorted(cpus), n)]


def _ranges(cpus: Sequence[int]) -> str:
    """CPU ids as vLLM and taskset write them: `0-3,8`."""
    out: list[str] = []
    ids = sorted(cpus)
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)


def parse_cpus(text: str) -> list[int]:
    """`0-3,8` back to [0, 1, 2, 3, 8]."""
    out: list[int] = []
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        if first:
            out += range(int(first), int(last or first) + 1)
    return out


def task_gpus(cfg: Any, env: Optional[dict[str, str]] = None) -> list[str]:
    """The GPUs this task may use: CUDA_VISIBLE_DEVICES (Slurm sets it from the allocation), else
    the first cluster.gpus_per_task GPUs; [] on a CPU node."""
    gpus = visible_gpus(env)
    if gpus or (env if env is not None else os.environ).get("CUDA_VISIBLE_DEVICES") is not None:
        return gpus
    return [str(i) for i in range(int(cfg.cluster.gpus_per_task or 0))]
