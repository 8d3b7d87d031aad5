"""`redo ... cluster=slurm` through the same submission as `submit` (Slurm faked on PATH): the pass's
array and merge job, `status` showing the pass's progress, `cancel` its jobs, `resume DIR` submitting
the unfinished pass again, and its merge job putting it into DIR's output."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support.corpus import read_output, write_corpus
from support.fake_slurm import SUBMITTED, cli
from support.procs import BlockedCli
from support.runs import run_overrides
from support.standin import StandinEngine

from batchinfer.config.compose import compose
from batchinfer.launch import slurm_merge
from batchinfer.launch.jobs import submissions
from batchinfer.launch.local import run_local, run_task
from batchinfer.rundir.store import RunDir


def test_redo_on_slurm_status_cancel_resume_and_merge_job(
    tmp_path: Path, tiny_model_path: Path, fake_bin: Any, capsys: pytest.CaptureFixture
) -> None:
    corpus = tmp_path / "c.jsonl"
    rows = write_corpus(corpus, 40, seed=12)
    cfg = compose(run_overrides(tiny_model_path, corpus, tmp_path / "run", "sampling.max_tokens=4"))
    root = run_local(cfg, engine=StandinEngine(cfg))
    length = [r["row"] for r in read_output(root.path) if r["finish_reason"] == "length"]
    before = root.output_path.read_bytes()
    fake_bin("sbatch", f'{SUBMITTED}echo "Submitted batch job $((700 + n))"')
    where = 'finish_reason == "length"'
    args = [
        "redo",
        str(root.path),
        "--where",
        where,
        "sampling.max_tokens=9",
        "cluster=slurm",
        "cluster.gpus_per_task=0",
    ]
    code, out, err = cli(args, capsys)
    assert code == 0, err
    pass_dir = root.path / "passes" / "1"
    assert f"{len(length)} rows match" in out and "(job 700); merge job 701" in out
    subs = submissions(RunDir(pass_dir))
    assert subs[0]["arrays"] == [{"job_id": "700", "tasks": {"0": [0]}}] and subs[0]["merge"] == "701"
    assert not (root.path / "jobs.jsonl").exists()  # the pass's jobs are recorded in the pass
    # status: the pass, unfinished, with its own shard table
    code, out, err = cli(["status", str(root.path)], capsys)
    assert code == 0, err
    assert f"pass 1: unfinished, {len(length)} rows, 0 of 1 shards done (--where '{where}'" in out
    assert f"{pass_dir}\n" in out and f"0 of {len(length)}" in out
    code, out, _ = cli(["status", "--json", str(root.path)], capsys)
    assert json.loads(out)["passes"][0]["state"] == "unfinished"
    # cancel DIR cancels the pass's jobs
    code, out, _ = cli(["cancel", str(root.path)], capsys)
    assert code == 0 and "700" in (fake_bin.folder / "scancel.calls").read_text().split()
    # resume DIR submits the unfinished pass again (the run's own shards are done)
    code, out, err = cli(["resume", str(root.path)], capsys)
    assert code == 0, err
    assert "pass 1 of" in out and "(job 702); merge job 703" in out
    assert len(submissions(RunDir(pass_dir))) == 2
    assert root.output_path.read_bytes() == before  # nothing merged while the pass is unfinished
    # what the array task and the merge job run
    run_task(str(pass_dir), 0, engine=StandinEngine(cfg))
    assert "merged" in slurm_merge(str(pass_dir))
    after = read_output(root.path)
    assert [r["row"] for r in after if r["pass"] == 1] == length
    assert [r["id"] for r in after] == [r["id"] for r in rows]
    code, out, _ = cli(["status", str(root.path)], capsys)
    assert "pass 1: merged" in out
    code, out, _ = cli(["report", "--json", str(root.path)], capsys)
    assert json.loads(out)["passes"] == {"0": 40 - len(length), "1": len(length)}


def submitted_pass(
    tmp_path: Path, model: Path, fake_bin: Any, capsys: pytest.CaptureFixture
) -> tuple[RunDir, Path, list[str]]:
    """A finished run of 40 rows and `redo ... cluster=slurm` of it submitted (array 700, merge job
    701): DIR, the fake sbatch and the redo's arguments."""
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 40, seed=12)
    cfg = compose(run_overrides(model, corpus, tmp_path / "run", "sampling.max_tokens=4"))
    root = run_local(cfg, engine=StandinEngine(cfg))
    sbatch = fake_bin("sbatch", f'{SUBMITTED}echo "Submitted batch job $((700 + n))"')
    args = ["redo", str(root.path), "--where", 'finish_reason == "length"', "cluster=slurm", "cluster.gpus_per_task=0"]
    code, out, err = cli(args, capsys)
    assert code == 0 and "(job 700); merge job 701" in out, err
    return root, sbatch, args


def test_the_same_redo_while_its_pass_jobs_are_queued_submits_nothing(
    tmp_path: Path, tiny_model_path: Path, fake_bin: Any, capsys: pytest.CaptureFixture
) -> None:
    root, sbatch, args = submitted_pass(tmp_path, tiny_model_path, fake_bin, capsys)
    fake_bin("squeue", 'echo "700_0|700|PENDING|bi-x"; echo "701|701|PENDING|bi-x"')
    code, out, err = cli(args, capsys)
    assert code != 0 and "700_0 PENDING" in err and "701 PENDING" in err
    assert sbatch.with_suffix(".count").read_text().strip() == "2"  # the array and merge job of the first only
    assert len(submissions(RunDir(root.path / "passes" / "1"))) == 1


def test_resume_while_a_redo_submits_the_same_pass_is_refused_naming_it(
    tmp_path: Path, tiny_model_path: Path, fake_bin: Any, capsys: pytest.CaptureFixture
) -> None:
    root, sbatch, args = submitted_pass(tmp_path, tiny_model_path, fake_bin, capsys)
    # its jobs ended unfinished (squeue lists nothing): the same redo submits the pass again, and
    # stops right before sbatch; a resume of DIR meanwhile would submit a second array beside it
    with BlockedCli("batchinfer.launch.submit:submit_shards", args) as second:
        second.blocked()
        code, out, err = cli(["resume", str(root.path)], capsys)
        assert code != 0 and f"pid {second.pid}" in err, err
        res = second.release()
    assert res.returncode == 0 and "(job 702); merge job 703" in res.stdout, res.stderr
    assert sbatch.with_suffix(".count").read_text().strip() == "4"
    assert len(submissions(RunDir(root.path / "passes" / "1"))) == 2
