"""A preemption notice (USR2) as an array task starts, on the dev cluster with the stand-in engine:
the run still ends with its merged output, without a `resume` (issue 27, item 10). The signal is
made to land before Python runs (the batch shell kills itself by USR2 once), not left to a race;
that USR2 landing once Python runs stays pending is shown in tests/unit/launch/test_usr2_at_start.py."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from support.corpus import assert_exactly_once, read_output
from support.slurm import first_submission, submit_corpus, wait_until_idle
from support.standin import standin_env

pytestmark = [pytest.mark.slurm]
EXTRA = ["sharding.num_shards=2", "cluster.shards_per_task=2", "sampling.max_tokens=8"]


def submissions_made(run_dir: Path) -> dict[int, bool]:
    """{submission: made by the merge job's heal} from jobs.jsonl."""
    out: dict[int, bool] = {}
    for line in (run_dir / "jobs.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["submission"]] = out.get(rec["submission"], False) or bool(rec.get("heal"))
    return out


def sacct_state(job: str) -> str:
    res = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "State,ExitCode", "-j", job], capture_output=True, text=True)
    return res.stdout.strip()


@pytest.mark.timeout(900)
def test_a_task_killed_by_usr2_before_python_runs_is_submitted_again_by_the_merge_job(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    """The window no code can close: the task's shell killed by USR2 before the worker exists (here,
    the user's setup line does it on the first run). The merge job submits the task's shards again."""
    once = tmp_path / "usr2-once.sh"
    once.write_text(f"if [ ! -e {tmp_path}/killed ]; then touch {tmp_path}/killed; kill -USR2 $$; fi\n")
    setup = f"cluster.setup=['source {once}']"
    rows, run_dir, _ = submit_corpus(tmp_path, tiny_model_path, 60, 31, *EXTRA, setup, env=standin_env())
    first = first_submission(run_dir)["arrays"][0]["job_id"]  # an array of one task: its job id
    wait_until_idle(run_dir)
    assert (tmp_path / "killed").exists()
    assert sacct_state(first) == "FAILED|0:12"  # the task died by USR2 ...
    assert submissions_made(run_dir) == {0: False, 1: True}  # ... and the merge job submitted it again
    assert_exactly_once(read_output(run_dir), rows)  # no `resume` typed
