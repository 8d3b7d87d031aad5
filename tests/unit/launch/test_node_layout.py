"""What a task over several nodes (cluster.nodes_per_task) asks Slurm for, as submit and its dry run
print it: the layout and the #SBATCH lines, the same lines the submission script sbatch gets holds
(fake sbatch, no cluster)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from support.fake_slurm import SUBMITTED, cli, overrides

NODES = [
    "cluster.nodes_per_task=2",
    "cluster.gpus_per_task=8",
    "model.tensor_parallel_size=8",
    "model.pipeline_parallel_size=2",
    "sharding.num_shards=2",
]
ASKED = ["#SBATCH --gpus-per-task=8", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1"]


def printed_sbatch_lines(out: str) -> list[str]:
    """The #SBATCH lines submit printed under `each array task asks Slurm for:`."""
    return [ln.strip() for ln in out.splitlines() if ln.startswith("    #SBATCH")]


def test_dry_run_says_the_layout_and_the_sbatch_lines(tmp_path: Path, fake_bin: Any, capsys) -> None:
    code, out, err = cli(["submit", "--dry-run", *overrides(tmp_path, 8, *NODES)], capsys)
    assert code == 0, err
    assert "nodes per task: 2 (cluster.nodes_per_task=2), 8 GPUs on each: one engine of TP 8 x PP 2 = 16 ranks" in out
    assert "  each array task asks Slurm for:" in out
    # --gpus-per-task with one task per node: 8 GPUs on each node; cpus-per-task and mem of the preset
    assert [ln for ln in printed_sbatch_lines(out) if ln in ASKED] == ASKED
    assert (
        "    srun --nodes=1 --ntasks=1 <the worker>: the worker, on the first node only; it starts the engine " in out
    )
    assert "ranks of the other 1 node as a step of its own (srun --nodes=1 --ntasks-per-node=1)" in out


def test_submit_prints_what_the_submission_script_asks_for(tmp_path: Path, fake_bin: Any, capsys) -> None:
    fake_bin("sbatch", f'{SUBMITTED}echo "Submitted batch job $((700 + n))"')
    code, out, err = cli(["submit", *overrides(tmp_path, 8, *NODES)], capsys)
    assert code == 0, err
    assert "nodes per task: 2 (cluster.nodes_per_task=2)" in out and "(job 700); merge job 701" in out
    script = next((tmp_path / "run/logs/submission-000").glob("700_*submission.sh")).read_text()
    asked = [
        ln
        for ln in script.splitlines()
        if re.match(r"#SBATCH --(nodes|ntasks-per-node|gpus-per-task|cpus-per-task|mem)=", ln)
    ]
    assert printed_sbatch_lines(out) == asked and set(ASKED) <= set(asked)
    srun = next(ln for ln in script.splitlines() if ln.startswith("srun "))
    assert srun.split("--error")[1].split()[1:3] == ["--nodes=1", "--ntasks=1"]  # the printed step, in the script


def test_one_node_submissions_print_no_layout(tmp_path: Path, fake_bin: Any, capsys) -> None:
    code, out, err = cli(["submit", "--dry-run", *overrides(tmp_path, 8)], capsys)
    assert code == 0, err
    assert "nodes per task" not in out and "asks Slurm for" not in out
