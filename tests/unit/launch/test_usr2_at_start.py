"""A preemption notice (USR2) as a task starts: the step's Python holds it pending from its first
statement, and the merge job submits again the shards of a task killed by it before that (fake
sbatch and sacct, no cluster)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.fake_slurm import SUBMITTED, cli, overrides

from batchinfer.errors import RunDirError
from batchinfer.launch import executor, sacct, slurm_merge
from batchinfer.launch.jobs import submissions
from batchinfer.rundir.store import RunDir

# What sacct says of an array of three tasks: 0 killed by USR2 in its batch shell (plain sbatch's
# case), 1 whose srun step died by USR2 (srun exits 12), 2 completed; a cancel and a pending range.
SACCT = """\
700_0|FAILED|0:12
700_0.batch|FAILED|0:12
700_0.extern|COMPLETED|0:0
700_1|FAILED|12:0
700_1.batch|FAILED|12:0
700_1.0|FAILED|0:12
700_2|COMPLETED|0:0
700_2.0|COMPLETED|0:0
700_3|CANCELLED by 1000|0:15
700_4|FAILED|2:0
700_[5-9]|PENDING|0:0
"""


def test_sacct_lines_name_the_tasks_usr2_killed() -> None:
    assert sacct.usr2_deaths(SACCT) == {"700_0", "700_1"}
    endings = sacct.task_endings(SACCT + "701|RUNNING|0:0\n702|FAILED|0:12\n702.batch|CANCELLED|0:12\n")
    assert (endings["700_2"], endings["700_3"], endings["701"], endings["702"]) == ("ended", "ended", "running", "usr2")
    # a step killed by USR2 in a task that still runs (or was queued again) is no death to heal
    running = sacct.task_endings(
        "703_0|RUNNING|0:0\n703_0.0|FAILED|0:12\n704_1|PENDING|0:0\n704_1.batch|CANCELLED|0:12\n"
    )
    assert running == {"703_0": "running", "704_1": "running"}


def test_the_step_python_holds_usr2_from_its_first_statement(tmp_path: Path) -> None:
    """submitit runs `{python} -u -m submitit.core._submit FOLDER` in the step: with our `python`, a
    USR2 once the module runs (while submitit loads and unpickles the task) stays pending for
    the worker instead of killing the step. Plain python is killed."""
    (tmp_path / "probe.py").write_text(
        "import signal, sys\nprint('ready', sys.argv[1:], flush=True)\nsys.stdin.read()\n"
        "print('pending', sorted(s.name for s in signal.sigpending()), flush=True)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    results = {}
    for name, python in (("ours", executor.step_python()), ("plain", sys.executable)):
        proc = subprocess.Popen(
            f"exec {python} -u -m probe FOLDER",
            shell=True,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout.readline().strip() == "ready ['FOLDER']"
        os.kill(proc.pid, signal.SIGUSR2)  # the module runs: as submitit's would, unpickling
        out, _ = proc.communicate("", timeout=60)
        results[name] = (proc.returncode, out.strip())
    assert results["ours"] == (0, "pending ['SIGUSR2']")
    assert results["plain"] == (-signal.SIGUSR2, "")


def test_the_array_script_starts_python_with_usr2_blocked(tmp_path: Path, fake_bin: Any, capsys: Any) -> None:
    fake_bin("sbatch", f'{SUBMITTED}echo "Submitted batch job $((700 + n))"')
    code, _, err = cli(["submit", *overrides(tmp_path, 6, "cluster.gpus_per_task=0")], capsys)
    assert code == 0, err
    script = next((tmp_path / "run/logs/submission-000").glob("700_*submission.sh")).read_text()
    (command,) = [ln for ln in script.splitlines() if ln.startswith("srun ")]
    assert "pthread_sigmask" in command and command.index("pthread_sigmask") < command.index("submitit.core._submit")


@pytest.fixture
def submitted(tmp_path: Path, fake_bin: Any, capsys: Any) -> RunDir:
    """A run of 6 shards, 2 per task, submitted as array 700 (tasks 0-2) and merge job 701; every
    sbatch call records the SLURM_ variables it saw."""
    calls = tmp_path / "sbatch.env"
    fake_bin(
        "sbatch",
        f'{SUBMITTED}env | grep "^SLURM_" | sort | tr "\\n" " " >> "{calls}"; echo >> "{calls}"; '
        'echo "Submitted batch job $((700 + n))"',
    )
    # sacct answers of any array (the last argument) as SACCT says of 700; with -X (the states
    # `heal` checks first: is a job of DIR still queued or running?) the tasks' own lines, as
    # sacct -X prints them: no steps, and no pending range (this run has no tasks 5-9).
    fake_bin(
        "sacct",
        'for a; do j=$a; done\ncase " $* " in *" -X "*) keep="^[^.[]*$";; *) keep="";; esac\n'
        f'cat <<"EOF" | sed "s/^700/$j/" | grep -e "$keep"\n{SACCT}EOF',
    )
    ov = overrides(tmp_path, 12, "cluster.gpus_per_task=0", "sharding.num_shards=6", "cluster.shards_per_task=2")
    code, _, err = cli(["submit", *ov, "cluster.max_attempts=2"], capsys)
    assert code == 0, err
    return RunDir(tmp_path / "run")


def test_the_merge_job_submits_again_the_shards_of_tasks_usr2_killed(
    submitted: RunDir, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The merge job runs as a Slurm job: its own variables must not reach the jobs it submits.
    monkeypatch.setenv("SLURM_JOB_ID", "701")
    monkeypatch.setenv("SLURM_MEM_PER_CPU", "2000")
    first = submissions(submitted)[0]
    assert first["arrays"][0]["tasks"] == {"0": [0, 1], "1": [2, 3], "2": [4, 5]}
    assert "submission 1" in slurm_merge(str(submitted.path))
    again = submissions(submitted)[1]
    assert sum(again["arrays"][0]["tasks"].values(), []) == [0, 1, 2, 3]  # tasks 0 and 1; not 2 (done)
    assert again["merge"] is not None  # its own merge job merges, or heals once more
    env_seen = (tmp_path / "sbatch.env").read_text().splitlines()
    assert len(env_seen) == 4 and all("SLURM_JOB_ID" not in e and "SLURM_MEM_PER_CPU" not in e for e in env_seen)
    assert os.environ["SLURM_JOB_ID"] == "701"  # and are back afterwards
    # sacct says the same of the new array (the fake answers so): once more, then max_attempts=2 stops it.
    slurm_merge(str(submitted.path))
    with pytest.raises(RunDirError, match="incomplete|not finished|missing"):
        slurm_merge(str(submitted.path))
    lines = [json.loads(ln) for ln in (submitted.path / "jobs.jsonl").read_text().splitlines()]
    assert [ln["submission"] for ln in lines if ln.get("heal")] == [1, 2]


def test_the_merge_job_submits_nothing_again_while_a_job_of_dir_still_runs(
    submitted: RunDir, monkeypatch: pytest.MonkeyPatch, fake_bin: Any
) -> None:
    """A task of DIR still queued or running (a requeue, a resume) would write those shards: the
    heal waits for it rather than racing it, and merge refuses as it would without a heal."""
    monkeypatch.setenv("SLURM_JOB_ID", "701")
    fake_bin("squeue", 'echo "700_1|700|RUNNING|run"; echo "701|701|RUNNING|merge"')
    from batchinfer.launch import submit

    said: list[str] = []
    monkeypatch.setattr(submit.log, "warning", lambda msg, *args: said.append(msg % args))
    with pytest.raises(RunDirError):
        slurm_merge(str(submitted.path))
    assert len(submissions(submitted)) == 1  # nothing submitted again
    assert said == ["shards [0, 1, 2, 3] not submitted again: jobs of DIR still queued or running (['700_1'])"]


# `batchinfer` for the sbatch script: the real main, with a worker that says what it was given.
FAKE_BATCHINFER = """#!{python}
import signal, sys
from batchinfer import cli
def worker(args):
    pending = sorted(s.name for s in signal.sigpending())
    print("worker", args.dir, args.task, "pending", pending, "ignored", signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN)
    return 0
cli.COMMANDS["worker"] = worker
sys.exit(cli.main())
"""


@pytest.mark.parametrize("signalled", [True, False])
def test_the_sbatch_script_hands_a_usr2_it_caught_to_the_worker(tmp_path: Path, signalled: bool) -> None:
    """USR2 while the batch shell runs the user's setup lines (plain sbatch): the shell notes it and
    the worker has it pending, to act on once its handler is in place, instead of the shell
    dying by it and the task failing."""
    from support import REPO

    script = (REPO / "slurm/batchinfer.sbatch").read_text()
    setup = "# module load cuda"
    assert setup in script
    # the user's setup lines take a while: here, until the test says go
    waiting = f"touch {tmp_path}/in-setup; while [ ! -e {tmp_path}/go ]; do sleep 0.05; done"
    (tmp_path / "job.sh").write_text(script.replace(setup, waiting))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "batchinfer").write_text(FAKE_BATCHINFER.format(python=sys.executable))
    (bin_dir / "batchinfer").chmod(0o755)
    env = dict(
        os.environ,
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        PYTHONPATH=str(REPO),
        SLURM_ARRAY_TASK_ID="3",
        BATCHINFER_PENDING_STOP="USR2",  # left in the submitting shell: sbatch's --export=ALL hands it on
    )
    proc = subprocess.Popen(["bash", str(tmp_path / "job.sh"), "DIR"], env=env, stdout=subprocess.PIPE, text=True)
    while not (tmp_path / "in-setup").exists():
        assert proc.poll() is None
    if signalled:
        os.kill(proc.pid, signal.SIGUSR2)  # `scancel -b --signal=USR2`, or B:USR2
    (tmp_path / "go").touch()
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    pending = "['SIGUSR2']" if signalled else "[]"
    assert out.strip() == f"worker DIR 3 pending {pending} ignored False"


def test_a_slurm_task_blocks_usr2_before_it_runs_anything(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Under submitit nothing blocks USR2 for the task (submitit's handler would requeue behind the
    worker's back, members would start with it deliverable): slurm_task does, first thing."""
    import batchinfer.launch as launch

    seen = []
    monkeypatch.setattr(launch, "RunDir", lambda d: d)
    monkeypatch.setattr(
        launch, "run_shards", lambda run, shards: seen.append(signal.pthread_sigmask(signal.SIG_BLOCK, []))
    )
    before = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR2})
    try:
        launch.slurm_task(str(tmp_path), [0])
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
    assert signal.SIGUSR2 in seen[0]
