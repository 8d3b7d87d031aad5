"""The commit policy: a window in seconds of work, a row cap, and a bounded number of parts per shard."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from support.corpus import read_output
from support.fake_engine import FakeEngine, keyed, prepared

from batchinfer.config.schema import OutputConfig
from batchinfer.engine.commit_policy import LONGEST_WINDOW_S, PARTS_PER_SHARD, CommitPolicy
from batchinfer.launch.local import run_shards
from batchinfer.rundir.merge import merge


def test_the_defaults_commit_every_few_seconds_of_work() -> None:
    """What a kill may lose is a window of seconds whatever the rate: rows alone do not trigger a
    commit at a GPU's rate (a 10,000-row default shard takes ~5 s at 2,000 rows/s)."""
    out = OutputConfig()
    policy = CommitPolicy.for_shard(out, 10_000)
    assert policy == CommitPolicy(out.commit_every_rows, out.commit_every_seconds, 157, LONGEST_WINDOW_S)
    assert out.commit_every_seconds <= 5 and out.commit_every_rows >= 10_000
    assert not policy.due(2_000, 0.9 * out.commit_every_seconds)  # a second of work at 2,000 rows/s waits
    assert policy.due(157, out.commit_every_seconds)
    assert not policy.due(156, out.commit_every_seconds)  # a part holds 1/64 of its shard
    assert policy.due(1, LONGEST_WINDOW_S)  # ... unless its rows waited a minute
    assert not policy.due(0, 10 * LONGEST_WINDOW_S)
    assert policy.due(out.commit_every_rows, 0.0)


def test_small_shards_and_small_row_caps() -> None:
    out = SimpleNamespace(commit_every_rows=4, commit_every_seconds=2.0)
    assert CommitPolicy.for_shard(out, 12).min_rows == 1
    assert CommitPolicy.for_shard(out, 100_000).min_rows == 4  # never more than the row cap
    slow = SimpleNamespace(commit_every_rows=1000, commit_every_seconds=300.0)
    assert CommitPolicy.for_shard(slow, 100).longest_s == 300.0  # a longer window asked for is kept


def test_a_shard_whose_rows_finish_one_by_one_leaves_a_bounded_number_of_parts(tmp_path: Path) -> None:
    """Every engine step is past the window (a window of a microsecond) and finishes one row: a
    part is committed only once 1/64 of the shard waits, not at every step; every row once."""
    rows = 640
    run = prepared(tmp_path, rows, "output.commit_every_seconds=0.000001", "output.commit_every_rows=100000")
    run_shards(run, [0], engine=keyed(FakeEngine(per_step=1), run))
    done = json.loads(run.shard_folder(0).done_path.read_text())
    assert 2 <= done["parts"] <= PARTS_PER_SHARD + 1 and done["rows_done"] == rows
    merge(run)
    assert [r["row"] for r in read_output(run.path)] == list(range(rows))
