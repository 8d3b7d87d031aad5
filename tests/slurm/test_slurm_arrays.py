"""Array splitting on a real cluster: the dev cluster restarted with MaxArraySize=4 (the tasks run the
stand-in engine: how Slurm runs them is what this proves)."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.corpus import assert_exactly_once, read_output, write_corpus
from support.procs import run_cli
from support.slurm import cluster_overrides, first_submission, status_json, use_dev_cluster, wait_until_idle
from support.standin import standin_env

pytestmark = [pytest.mark.slurm, pytest.mark.engine]
MAX_ARRAY_SIZE = 4


@pytest.fixture(scope="module")
def small_arrays() -> Iterator[None]:
    """The dev cluster with MaxArraySize=4 for this module, Slurm's default (1001) again after it."""
    use_dev_cluster(MAX_ARRAY_SIZE=str(MAX_ARRAY_SIZE))
    config = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True).stdout
    assert f"MaxArraySize            = {MAX_ARRAY_SIZE}" in config
    try:
        yield
    finally:
        use_dev_cluster()


def _times(job: str) -> list[tuple[str, dt.datetime, dt.datetime]]:
    """(job id, start, end) of every task of a job or array, from sacct."""
    res = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-j", job, "-o", "JobID,Start,End"], capture_output=True, text=True, check=True
    )
    out = []
    for line in res.stdout.splitlines():
        jid, start, end = line.split("|")
        out.append((jid, dt.datetime.fromisoformat(start), dt.datetime.fromisoformat(end)))
    return out


@pytest.mark.timeout(1200)  # its tasks run one after another (array parallelism 1)
def test_ten_shards_over_two_arrays_each_run_once_and_merge_waits(
    small_arrays: None, tmp_path: Path, tiny_model_path: Path
) -> None:
    # 10 shards, 2 per task: 5 tasks, more than MaxArraySize=4 allows in one array (indices 0..3).
    corpus = tmp_path / "c.jsonl"
    rows = write_corpus(corpus, 40, seed=23)
    ov = cluster_overrides(
        tmp_path,
        corpus,
        tiny_model_path,
        "sharding.num_shards=10",
        "cluster.shards_per_task=2",
        "sampling.max_tokens=4",
    )
    res = run_cli(["submit", *ov], env=standin_env())
    assert res.returncode == 0, res.stderr
    assert "submitted 10 shards" in res.stdout and "as 5 array tasks" in res.stdout
    run_dir = tmp_path / "run"
    sub = first_submission(run_dir)
    assert [a["tasks"] for a in sub["arrays"]] == [
        {"0": [0, 1], "1": [2, 3], "2": [4, 5], "3": [6, 7]},
        {"0": [8, 9]},
    ]
    wait_until_idle(run_dir)
    assert_exactly_once(read_output(run_dir), rows)
    st = status_json(run_dir)
    assert st["totals"]["states"] == {"done": 10} and st["totals"]["rows_done"] == 40
    # every shard ran once: one attempt each, in the task that the submission gave it
    for shard in range(10):
        done = json.loads((run_dir / f"shards/{shard:05d}/DONE.json").read_text())
        assert done["attempts"] == 1, (shard, done)
    tasks = [t for a in sub["arrays"] for t in _times(a["job_id"])]
    assert len(tasks) == 5, tasks
    [(_, merge_start, _)] = _times(sub["merge"])
    assert merge_start >= max(end for _, _, end in tasks), (merge_start, tasks)


def test_ten_thousand_shards_dry_run(small_arrays: None, tmp_path: Path, tiny_model_path: Path) -> None:
    # 10,000 one-row shards planned against the cluster's own MaxArraySize: 2,500 arrays of 4 tasks.
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 10_000, seed=5, max_words=3)
    ov = cluster_overrides(tmp_path, corpus, tiny_model_path, "sharding.rows_per_shard=1", "cluster.shards_per_task=1")
    res = run_cli(["submit", "--dry-run", *ov])
    assert res.returncode == 0, res.stderr
    arrays = [line for line in res.stdout.splitlines() if line.startswith("array ")]
    assert len(arrays) == 2500 and all(a.split(":")[1].startswith(" 4 tasks") for a in arrays)
    shards = [int(line.split("[")[1].rstrip("]")) for line in res.stdout.splitlines() if line.startswith("  task ")]
    assert shards == list(range(10_000))
    assert not (tmp_path / "run" / "jobs.jsonl").exists()
