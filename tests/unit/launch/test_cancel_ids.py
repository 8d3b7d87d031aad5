"""`batchinfer cancel DIR` passes scancel only Slurm job ids and job names from DIR/jobs.jsonl:
anyone who can write DIR can write that file, and an id like `--user=root` would cancel every job
of the user running cancel (issue 40). Slurm's commands are faked on PATH."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support.fake_slurm import cli

from batchinfer.errors import ConfigError
from batchinfer.launch import slurm

LINES = [
    {"submission": 1, "name": "bi-run-1", "arrays": [{"job_id": "101", "tasks": {"0": [0]}}], "merge": "102"},
    {"submission": 2, "name": "--user=root", "arrays": [{"job_id": "--user=root", "tasks": {"0": [1]}}]},
    {"submission": 2, "job_id": "1,2", "tasks": {"1": [2]}},
    {"submission": 2, "job_id": "103 --me", "tasks": {"2": [3]}},
    {"submission": 2, "job_id": "104_3", "tasks": {"3": [4]}},
    {"submission": 2, "merge": "-u root"},
]


def test_cancel_passes_only_slurm_job_ids(tmp_path: Path, fake_bin: Any, capsys: pytest.CaptureFixture) -> None:
    d = tmp_path / "run"
    d.mkdir()
    (d / "jobs.jsonl").write_text("".join(json.dumps(line) + "\n" for line in LINES))
    code, out, err = cli(["cancel", str(d)], capsys)
    assert code == 0, err
    calls = (fake_bin.folder / "scancel.calls").read_text().splitlines()
    assert calls == ["--verbose 101 102 104_3"]  # submission 2 was cut short, but its name is no name: not asked
    assert "--user=root" not in "".join(calls) and "-u" not in "".join(calls)
    assert "ignored '--user=root', '--user=root': not a Slurm job id or job name" in err
    assert "ignored '1,2'" in err and "ignored '103 --me'" in err and "ignored '-u root'" in err
    assert err.count("ignored '1,2'") == 1  # each line of jobs.jsonl is read once


def test_cancel_counts_only_the_jobs_scancel_acted_on(
    tmp_path: Path, fake_bin: Any, capsys: pytest.CaptureFixture
) -> None:
    """scancel exits 0 for a finished or unknown id and says so only with --verbose: those are
    named apart, not counted as cancelled."""
    d = tmp_path / "run"
    d.mkdir()
    (d / "jobs.jsonl").write_text(json.dumps(LINES[0]) + "\n")
    fake_bin(
        "scancel",
        'for j in "$@"; do [ "$j" = --verbose ] || echo "scancel: Terminating job $j" >&2; done; '
        'echo "scancel: error: Kill job error on job id 102: Job/step already completing or completed" >&2',
    )
    code, out, err = cli(["cancel", str(d)], capsys)
    assert code == 0, err
    assert f"cancelled 1 jobs of {d}: 101\n" in out
    assert (
        "not cancelled (already finished, or unknown to Slurm): 102 (Job/step already completing or completed)" in out
    )


@pytest.mark.parametrize("bad", ["--user=root", "1,2", "", "12 13", "-1", "12_", "12_a", "12_[1-3]"])
def test_scancel_is_never_given_anything_but_ids(bad: str, fake_bin: Any) -> None:
    with pytest.raises(ConfigError, match="not a Slurm job id or job name"):
        slurm.cancel(["101", bad])
    assert not (fake_bin.folder / "scancel.calls").exists()


@pytest.mark.parametrize("bad", ["--user=root", "a,b", "", "a b", "-n"])
def test_scancel_is_never_given_anything_but_names(bad: str, fake_bin: Any) -> None:
    with pytest.raises(ConfigError, match="not a Slurm job id or job name"):
        slurm.cancel([], ["bi-run-1", bad])
    assert not (fake_bin.folder / "scancel.calls").exists()
