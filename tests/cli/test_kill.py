"""SIGKILL and named fault points in a real `batchinfer run` subprocess, then resume: exactly once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
from support.corpus import assert_exactly_once, project, read_output
from support.procs import ShmWatch, group_alive, kill_group, run_cli, spied_rows
from support.runs import (
    ROWS,
    Workload,
    assert_engine_output_kept_apart,
    assert_only_missing_rows_redone,
    committed_parts_are_whole,
    committed_rows,
    resume_and_check,
)

from batchinfer.config.compose import compose
from batchinfer.launch.local import run_local
from batchinfer.rundir.store import RunDir

pytestmark = [pytest.mark.engine, pytest.mark.kill]


def test_sigkill_group_after_first_part_then_cli_resume(workload: Workload, clean_shm: None) -> None:
    out = workload.dir / "killed"
    cmd = [sys.executable, "-m", "batchinfer.cli", "run", *workload.base, f"output.dir={out}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 300
    while not list(out.glob("shards/*/part-*")):
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    kill_group(proc)
    assert proc.returncode == -signal.SIGKILL
    assert group_alive(proc.pid) == []  # no engine process outlives the kill
    committed = committed_parts_are_whole(out)
    assert 0 < committed < ROWS
    before = committed_rows(out)
    spy = workload.dir / "killed-commits.jsonl"
    res = run_cli(["run", *workload.base, f"output.dir={out}"], spy=spy)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resuming" in res.stderr
    assert_engine_output_kept_apart(out, res.stderr)
    rows = read_output(out)
    assert_exactly_once(rows, workload.rows)
    assert project(rows) == project(workload.clean)
    assert_only_missing_rows_redone(out, before, spied_rows(spy), ROWS)


# Named fault points in the worker's commit protocol: the stand-in engine in the subprocess (the
# worker is what they test), but one killed mid-generation with vLLM's processes in its group.
REAL_ENGINE_FAULTS = {"in-generate:5"}


@pytest.mark.parametrize(
    "fault",
    [
        "in-part-write:2",
        "before-part-rename:2",
        "after-part-rename:2",
        "after-progress:3",
        "in-generate:5",
        "before-done:1",
    ],
)
def test_fault_point_then_resume(request: pytest.FixtureRequest, fault: str, clean_shm: None) -> None:
    work: Workload = request.getfixturevalue("workload" if fault in REAL_ENGINE_FAULTS else "standin_workload")
    out = work.dir / fault.replace(":", "-")
    res = run_cli(["run", *work.base, f"output.dir={out}"], env={**work.env, "BATCHINFER_FAULT": fault})
    assert res.returncode == -signal.SIGKILL, res.stderr[-3000:]
    assert group_alive(res.pid) == []  # the whole group died: no engine process left behind
    run = RunDir(out)
    committed = committed_parts_are_whole(out)
    assert committed < ROWS
    if fault.startswith(("in-part-write", "before-part-rename")):
        assert list(out.glob("shards/*/.tmp-part-*"))  # the torn write is there, and ignored
    if fault == "before-done:1":
        assert committed == ROWS // 2 and not run.shard_folder(0).is_done()
    resume_and_check(work, out)
    assert not list(out.glob("shards/*/.tmp-*"))


def test_kill_in_merge_then_merge_again(workload: Workload, engine: Any) -> None:
    out = workload.dir / "merge-fault"
    run = run_local(compose([*workload.base, f"output.dir={out}"]), engine=engine)
    run.output_path.unlink()
    res = run_cli(["merge", str(out)], env={"BATCHINFER_FAULT": "in-merge"})
    assert res.returncode == -signal.SIGKILL and group_alive(res.pid) == []
    assert not run.output_path.exists() and list(out.glob(".tmp-*output.parquet"))
    res = run_cli(["merge", str(out)])
    assert res.returncode == 0 and f"merged {ROWS} rows" in res.stdout
    assert project(read_output(out)) == project(workload.clean)


def test_usr2_during_engine_start_is_acted_on(workload: Workload, engine: Any, clean_shm: None) -> None:
    out = workload.dir / "usr2"
    cmd = [sys.executable, "-m", "batchinfer.cli", "run", *workload.base, f"output.dir={out}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True, text=True)
    watch = ShmWatch(proc.pid)
    log = ""
    while "starting vLLM engine" not in log:
        line = proc.stderr.readline()
        assert line, "worker exited before starting its engine"
        log += line
    time.sleep(3)  # well inside the engine start
    os.killpg(proc.pid, signal.SIGUSR2)  # what Slurm's --signal does: the whole group
    try:
        _, rest = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            kill_group(proc)
    assert proc.returncode == 128 + signal.SIGUSR2, (log + rest)[-3000:]
    assert "stopped by SIGUSR2" in rest and "engine ready" in rest
    assert not RunDir(out).shard_folder(0).is_done()
    time.sleep(1)
    assert group_alive(proc.pid) == []
    # a stopped run leaves nothing in /dev/shm of what its engine's processes held
    segments = watch.stop()
    assert segments and not [n for n in segments if os.path.exists(f"/dev/shm/{n}")]
    resume_and_check(workload, out, engine)
