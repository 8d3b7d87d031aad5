"""What a task whose engine spans several nodes (cluster.nodes_per_task) asks Slurm for, as
`submit` and `submit --dry-run` print it: the layout, and the #SBATCH lines submitit writes for
it, rendered by submitit itself (not a copy of its rules), so what is printed is what sbatch gets."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from batchinfer.config.nodes import describe_nodes
from batchinfer.launch import slurm
from batchinfer.launch.executor import make_executor

# The #SBATCH keys that place a task: how many nodes, tasks, GPUs, cores and memory it gets.
LAYOUT_KEYS = ("nodes", "ntasks-per-node", "gpus-per-task", "gpus-per-node", "gres", "cpus-per-task", "mem")
COMMAND = "<the worker>"  # stands for submitit's python command in the rendered script


def sbatch_script(c: Any, n_tasks: int, folder: Path, name: str) -> str:
    """The batch script of a worker array of n_tasks as submitit writes it (no file, no sbatch)."""
    from submitit.slurm import slurm as submitit_slurm

    ex = make_executor(folder, {**slurm.array_parameters(c.cluster, n_tasks), "job_name": name})
    # submitit's own renderer (SlurmExecutor renders through it); map_count makes it an array
    return submitit_slurm._make_sbatch_string(command=COMMAND, folder=ex.folder, map_count=n_tasks, **ex.parameters)


def layout_lines(c: Any, n_tasks: int, folder: Path, name: str) -> list[str]:
    """The layout of a task over several nodes and the sbatch lines that ask for it."""
    n = c.cluster.nodes_per_task
    lines = [f"nodes per task: {describe_nodes(c)}", "  each array task asks Slurm for:"]
    script = sbatch_script(c, n_tasks, folder, name).splitlines()
    for line in script:
        key = line.removeprefix("#SBATCH --").split("=")[0]
        if line.startswith("#SBATCH --") and key in LAYOUT_KEYS:
            lines.append(f"    {line}")
    srun = next(ln for ln in script if ln.startswith("srun "))
    step = [a for a in shlex.split(srun) if a.startswith(("--nodes", "--ntasks"))]
    lines.append(
        f"    srun {' '.join(step)} {COMMAND}: the worker, on the first node only; it starts the engine ranks of "
        f"the other {n - 1} node{'s' * (n > 2)} as a step of its own (srun --nodes={n - 1} --ntasks-per-node=1)"
    )
    return lines
