"""`tune ... cluster=slurm` with Slurm's commands faked on PATH (no cluster, no engine): one job
submitted with the array task's resources and the tune's time, recorded in TUNE/job.json; the job's
call composes as the login node did and tunes into the same folder; `status TUNE` and `cancel TUNE`
work on it; the wait relays the job's lines and prints its table, or names why it ended without one.
The real job on the dev cluster: tests/slurm/test_slurm_tune.py."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from support.fake_slurm import SUBMITTED, cli, fake_slurm_bin, overrides
from support.log_handlers import restored_log_handlers

from batchinfer.config.compose import compose
from batchinfer.config.schema import to_config
from batchinfer.tune import remote
from batchinfer.tune.command import Options, config_fingerprint, finish
from batchinfer.tune.halving import Outcome, Rung
from batchinfer.tune.job import read_record
from batchinfer.tune.sample import Prompts
from batchinfer.tune.settings import Setting

SLURM = ["cluster.gpus_per_task=0", "cluster.cpus_per_task=2", "cluster.mem=null", "cluster.time=5"]
TRIES = ["--try", "model.max_num_seqs=8", "--try", "defaults"]


@pytest.fixture(autouse=True)
def own_log_handlers() -> Any:
    """setup_logging (run by main and the job) binds a handler to this test's captured stderr."""
    yield from restored_log_handlers()


@pytest.fixture
def fake_bin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    return fake_slurm_bin(tmp_path, monkeypatch)


def fake_result(cfg: Any, opts: Options) -> dict[str, Any]:
    """What tune() writes for a pilot of 8 rows of which `model.max_num_seqs=8` was the fastest,
    measured twice each (a rung and its repeat), so it separated from the defaults."""
    plain, fp = config_fingerprint(cfg)
    c = to_config(plain)
    prompts = Prompts([str(i) for i in range(40)], [10 + i % 7 for i in range(40)], "tokens")

    def ran(setting: Setting, seconds: float) -> Outcome:
        rung = Rung(0, 8, 90, 48, seconds, output_lengths=[6] * 8, stopped_at_max_tokens=8)
        return Outcome(setting, 3.5, [rung], repeats=[rung])

    outcomes = [ran(Setting(("model.max_num_seqs=8",)), 1.0), ran(Setting(), 2.0)]
    return finish(c, opts, Path(opts.out or "."), fp, prompts, list(range(8)), outcomes, (None, None))


def submit_args(tmp_path: Path, *extra: str) -> list[str]:
    return ["tune", *overrides(tmp_path, 40, *SLURM), "--rows", "8", *TRIES, "--out", str(tmp_path / "T"), *extra]


def test_no_wait_submits_one_job_status_and_cancel_work_on_it(
    tmp_path: Path, fake_bin: Any, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    sbatch = fake_bin("sbatch", f'{SUBMITTED}cp "$1" "{tmp_path}/script.sh"; echo "Submitted batch job 4242"')
    folder = tmp_path / "T"
    code, out, err = cli(submit_args(tmp_path, "--no-wait"), capsys)
    assert code == 0, err
    assert (Path(f"{sbatch}.count").read_text().strip(), out.splitlines()[0]) == (
        "1",
        "submitted the tune as Slurm job 4242 (time limit 50 min)",  # --minutes 30 + 20 > cluster.time=5
    )
    assert f"batchinfer status {folder}" in out and f"batchinfer cancel {folder}" in out
    assert not (folder / "pilot.parquet").exists()  # nothing of the tune ran on the login node
    job = read_record(folder)
    assert job is not None and job.job_id == "4242" and job.time_minutes == 50
    assert job.request["cwd"] == os.getcwd() and job.request["options"]["out"] == str(folder)
    assert job.request["options"]["tries"] == ["model.max_num_seqs=8", "defaults"]
    script = (tmp_path / "script.sh").read_text()
    assert "#SBATCH --time=50" in script and "#SBATCH --cpus-per-task=2" in script
    assert f"#SBATCH --job-name={job.name}" in script and "--requeue" not in script and "--array" not in script
    assert "gpus" not in script  # cluster.gpus_per_task=0: a CPU partition

    # Slurm says it runs: status names it and says how to cancel; a second tune into it is refused
    fake_bin("squeue", 'echo "4242|4242|RUNNING|x"')
    code, out, err = cli(["status", str(folder)], capsys)
    assert code == 0, err
    assert out.splitlines()[0] == f"{folder}: tune job 4242 RUNNING" and "cancel:  batchinfer cancel" in out
    code, out, err = cli(submit_args(tmp_path, "--no-wait"), capsys)
    assert code == 2 and "its tune job 4242 is still RUNNING" in err
    assert Path(f"{sbatch}.count").read_text().strip() == "1"
    code, out, err = cli(["cancel", str(folder)], capsys)
    assert code == 0 and (fake_bin.folder / "scancel.calls").read_text().split() == ["--verbose", "4242"]

    # The job's call (what submitit pickled) composes in the login node's directory and tunes here.
    from submitit.core.utils import DelayedSubmission

    call = DelayedSubmission.load(folder / "logs" / "4242_submitted.pkl")
    assert call.function is remote.tune_job and call.args == (str(folder),)
    seen: list[tuple[Any, Options]] = []
    monkeypatch.setattr(remote, "tune", lambda cfg, opts: seen.append((cfg, opts)) or fake_result(cfg, opts))
    monkeypatch.chdir(tmp_path)  # a node starts elsewhere: the job goes to the login node's directory
    assert call.function(*call.args) == "model.max_num_seqs=8"
    assert "| model.max_num_seqs=8 * |" in capsys.readouterr().out  # the job's stdout: the table
    cfg, opts = seen[0]
    assert Path(os.getcwd()) == Path(job.request["cwd"])
    assert cfg == compose(overrides(tmp_path, 40, *SLURM))
    assert (opts.rows, opts.out, opts.tries) == (8, str(folder), ["model.max_num_seqs=8", "defaults"])

    # Ended: status shows the job's state and the table; --json carries tune.json as written
    fake_bin("squeue", "exit 0")
    fake_bin("sacct", 'echo "4242|COMPLETED"')
    code, out, err = cli(["status", str(folder)], capsys)
    assert code == 0, err
    assert out.startswith(f"{folder}: tune job 4242 COMPLETED\n") and "| model.max_num_seqs=8 * |" in out
    code, out, err = cli(["status", str(folder), "--json"], capsys)
    st = json.loads(out)
    assert (st["kind"], st["state"], st["done"]) == ("tune", "COMPLETED", True)
    assert st["result"] == json.loads((folder / "tune.json").read_text())


def test_wait_relays_the_jobs_lines_and_prints_its_table(
    tmp_path: Path, fake_bin: Any, capsys: pytest.CaptureFixture
) -> None:
    folder = tmp_path / "T"
    made = tmp_path / "made"
    cfg = compose(overrides(tmp_path, 40, *SLURM))
    result = fake_result(cfg, Options([], rows=8, out=str(made)))
    log = "[batchinfer 03:00:01] tune: drawing a 8-row pilot\\nvLLM noise\\n[batchinfer 03:00:09] [1/2] x: rung 0\\n"
    # the job, done at once: its result (written after the submission) and its stderr log
    fake_bin(
        "sbatch",
        f'cp "{made}/tune.json" "{folder}/tune.json"; mkdir -p "{folder}/logs"; '
        f'printf "{log}" > "{folder}/logs/77_0_log.err"; echo "Submitted batch job 77"',
    )
    fake_bin("sacct", 'echo "77|COMPLETED"')
    code, out, err = cli(submit_args(tmp_path, "--wait"), capsys)
    assert code == 0, err
    assert "[batchinfer 03:00:01] tune: drawing a 8-row pilot" in err and "[1/2] x: rung 0" in err
    assert "vLLM noise" not in err + out
    assert out.splitlines()[0] == "submitted the tune as Slurm job 77 (time limit 50 min)"
    assert "| model.max_num_seqs=8 * |" in out and out.rstrip().endswith(
        f"written: {folder}/ (tune.md, tune.png, tune.json, conf/)"
    )
    assert result["best"]["name"] == "model.max_num_seqs=8"

    # --json: stdout is the result alone, the submission's lines go to stderr
    fake_bin("sbatch", f'touch "{folder}/tune.json"; echo "Submitted batch job 78"')
    fake_bin("sacct", 'echo "78|COMPLETED"')
    code, out, err = cli(submit_args(tmp_path, "--json"), capsys)
    assert code == 0, err
    assert json.loads(out) == result and "submitted the tune as Slurm job 78" in err


def test_a_job_that_ends_without_a_result_is_named_with_its_error(
    tmp_path: Path, fake_bin: Any, capsys: pytest.CaptureFixture
) -> None:
    folder = tmp_path / "T"
    (folder / "logs").mkdir(parents=True)
    earlier = {"version": 1, "fingerprint": "0" * 64, "settings": [], "best": {"name": None}}
    (folder / "tune.json").write_text(json.dumps(earlier))  # an earlier tune's: older than this job, not its result
    for name in ("rungs", "trials"):  # and the rest of what a finished older tune made (tune/command.py)
        (folder / name).mkdir()
    (folder / "tune.md").write_text("earlier")
    (folder / "pilot.parquet").write_text("earlier")
    os.utime(folder / "tune.json", (1, 1))
    fake_bin(
        "sbatch",
        f'echo "batchinfer: error: model.path: no config.json" > "{folder}/logs/5_0_log.err"; echo "Submitted batch job 5"',
    )
    fake_bin("sacct", 'echo "5|FAILED"')
    code, out, err = cli(submit_args(tmp_path), capsys)
    assert code == 1
    assert err.strip().splitlines()[-1] == (
        "batchinfer: error: the tune job 5 ended FAILED without a result: batchinfer: error: model.path: no "
        f"config.json; its log: {folder}/logs/5_0_log.err"
    )
