"""A reusing run (output.reuse) SIGKILLed by a fault point while it commits reused rows, then the same
command: every row once, the old rows with the earlier run's answers, nothing committed twice. The
stand-in engine in the subprocess: the worker's commits are what is proven."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from support.corpus import assert_own_output, project, read_output, write_rows
from support.procs import group_alive, run_cli, spied_rows
from support.runs import ROWS, Workload, assert_only_missing_rows_redone, committed_parts_are_whole, committed_rows

from batchinfer.insight.report import build_report
from batchinfer.rundir.store import RunDir

pytestmark = [pytest.mark.kill]


def test_kill_during_a_reusing_run_then_the_same_command(standin_workload: Workload, tmp_path: Path) -> None:
    work = standin_workload
    new_rows = [{"id": f"new-{i:03d}", "text": f"a new row {i} about the quick fox"} for i in range(40)]
    rows = work.rows + new_rows
    corpus = write_rows(tmp_path / "grown.jsonl", rows)
    # the kill corpus grown by 40 rows, reusing the uninterrupted run of the first 600 (work.dir/clean)
    base = [o for o in work.base if not o.startswith("input.path=")]
    args = [
        "run",
        *base,
        f"input.path={corpus}",
        f"output.reuse={work.dir / 'clean'}",
        f"output.dir={tmp_path / 'run'}",
    ]
    res = run_cli(args, env={**work.env, "BATCHINFER_FAULT": "after-part-rename:3"})
    assert res.returncode == -signal.SIGKILL, res.stderr[-3000:]
    assert group_alive(res.pid) == []
    before = committed_rows(tmp_path / "run")
    assert 0 < committed_parts_are_whole(tmp_path / "run") == len(before) < len(rows)
    assert all(r["reused"] for r in before.values())  # the kill landed among committed reused rows

    spy = tmp_path / "commits.jsonl"
    res = run_cli(args, env=work.env, spy=spy)
    assert res.returncode == 0, res.stderr[-3000:]
    out = read_output(tmp_path / "run")
    assert [r["row"] for r in out] == list(range(len(rows))) and [r["id"] for r in out] == [r["id"] for r in rows]
    assert project(out[:ROWS]) == project(work.clean)  # the earlier run's answers, each row once
    assert [r["reused"] for r in out] == [True] * ROWS + [False] * len(new_rows)
    for r, x in zip(out[ROWS:], new_rows, strict=True):
        assert_own_output(r, x["text"])
    assert_only_missing_rows_redone(tmp_path / "run", before, spied_rows(spy), len(rows))
    assert build_report(RunDir(tmp_path / "run"))["totals"]["reused_rows"] == ROWS  # rebuilt from the parts
