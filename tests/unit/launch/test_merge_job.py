"""The merge job's time, memory and CPUs come from cluster.merge_time/merge_mem/merge_cpus, outside
the fingerprint: the sbatch script submitit writes carries them (fake sbatch, no cluster)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from support.fake_slurm import SUBMITTED, cli, overrides

from batchinfer.config.compose import compose
from batchinfer.launch.jobs import submissions
from batchinfer.launch.slurm import merge_parameters
from batchinfer.rundir.store import RunDir


def sbatch_options(script: Path) -> dict[str, str]:
    """The #SBATCH --key=value lines of a submission script."""
    return dict(re.findall(r"^#SBATCH --([\w-]+)=(.*)$", script.read_text(), re.M))


def test_merge_job_defaults_one_cpu_an_hour_the_partitions_memory() -> None:
    params = merge_parameters(compose(["cluster=slurm"]).cluster, ["7"])
    assert (params["time"], params["cpus_per_task"], "mem" in params) == (60, 1, False)
    assert params["dependency"] == "afterany:7" and "gpus_per_task" not in params


def test_merge_job_script_carries_the_merge_settings_and_resume_changes_them(
    tmp_path: Path,
    fake_bin: Any,
    capsys: pytest.CaptureFixture,
) -> None:
    fake_bin("sbatch", f'{SUBMITTED}echo "Submitted batch job $((700 + n))"')
    merge_settings = ["cluster.merge_time=45", "cluster.merge_mem=24G", "cluster.merge_cpus=4"]
    ov = overrides(tmp_path, 6, "cluster.gpus_per_task=0", "cluster.mem=64G", *merge_settings)
    code, out, err = cli(["submit", *ov], capsys)
    assert code == 0, err
    assert "(job 700); merge job 701" in out
    folder = tmp_path / "run/logs/submission-000"
    array = sbatch_options(next(folder.glob("700_*submission.sh")))
    merge_job = sbatch_options(next(folder.glob("701_*submission.sh")))
    assert (merge_job["time"], merge_job["mem"], merge_job["cpus-per-task"]) == ("45", "24G", "4")
    assert merge_job["dependency"] == "afterany:700" and "gpus-per-task" not in merge_job
    assert (array["time"], array["mem"], array["cpus-per-task"]) == ("240", "64G", "8")  # the workers' own
    # Outside the fingerprint: resume takes new merge settings.
    code, out, err = cli(["resume", str(tmp_path / "run"), "cluster.merge_mem=48G", "cluster.merge_time=90"], capsys)
    assert code == 0, err
    assert submissions(RunDir(tmp_path / "run"))[-1]["merge"] == "703"
    merge_job = sbatch_options(next((tmp_path / "run/logs/submission-001").glob("703_*submission.sh")))
    assert (merge_job["time"], merge_job["mem"], merge_job["cpus-per-task"]) == ("90", "48G", "4")


def test_merge_settings_are_checked() -> None:
    from batchinfer.errors import ConfigError

    with pytest.raises(ConfigError, match=r"cluster.merge_cpus=0 .*an integer >= 1"):
        compose(["cluster=slurm", "cluster.merge_cpus=0"])
