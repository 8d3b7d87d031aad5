"""Random kills, a second worker, a row that kills the engine, a full or read-only disk: nothing
committed is lost or duplicated, and each failure says what happened. Run alone with -m kill.
The subprocesses run the stand-in engine (tests/support/standin.py): the worker's commits, locks and
failure counts are what these prove; tests/cli/test_kill.py and tests/slurm kill real engines."""

from __future__ import annotations

import hashlib
import json
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from support.corpus import assert_exactly_once, project, read_output, write_corpus
from support.procs import group_alive, kill_group, run_cli
from support.runs import Workload, committed_parts_are_whole, committed_rows, model_overrides, resume_and_check

from batchinfer.config.compose import compose
from batchinfer.errors import RunDirError
from batchinfer.launch.local import run_local
from batchinfer.locks import ShardLock
from batchinfer.rundir.store import RunDir

pytestmark = [pytest.mark.engine, pytest.mark.kill]


def start_run(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    """`batchinfer run` in its own process group, with this environment."""
    cmd = [sys.executable, "-m", "batchinfer.cli", "run", *args]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True, env=env)


def wait_for_part(proc: subprocess.Popen, out: Path) -> None:
    """Until the first part of the run is committed."""
    deadline = time.monotonic() + 300
    while not list(out.glob("shards/*/part-*")):
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)


def fault_overrides(corpus: Path, model: Path, max_tokens: int) -> list[str]:
    """A run of corpus on the tiny model that commits every 16 rows."""
    return [
        f"input.path={corpus}",
        "input.id_column=id",
        f"sampling.max_tokens={max_tokens}",
        "output.commit_every_rows=16",
        *model_overrides(model),
    ]


def base_and_clean_run(corpus: Path, model: Path, engine: Any, max_tokens: int) -> tuple[list[str], list[dict]]:
    """Overrides committing every 16 rows, and the rows of an uninterrupted run with them."""
    base = fault_overrides(corpus, model, max_tokens)
    clean = read_output(run_local(compose([*base, f"output.dir={corpus.parent / 'clean'}"]), engine=engine).path)
    return base, clean


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sigkill_at_a_random_moment_then_resume(standin_workload: Workload, seed: int, clean_shm: None) -> None:
    workload = standin_workload
    out = workload.dir / f"random-{seed}"
    # 50 ms a step: a shard takes seconds, so the kill lands in generation, a part write or a rename
    proc = start_run([*workload.base, f"output.dir={out}"], dict(workload.env, BATCHINFER_STANDIN_STEP_SECONDS="0.05"))
    wait_for_part(proc, out)
    time.sleep(random.Random(seed).uniform(0.0, 2.0))  # in generation, a part write or a rename
    assert proc.poll() is None, "the run finished before the kill"
    kill_group(proc)
    assert proc.returncode == -signal.SIGKILL and group_alive(proc.pid) == []
    assert 0 < committed_parts_are_whole(out) < len(workload.rows)  # the kill left the run partial
    resume_and_check(workload, out)


def test_second_worker_refuses_and_a_dead_holders_lock_is_free(
    tmp_path: Path, tiny_model_path: Path, standin_workload: Workload, clean_shm: None
) -> None:
    # One shard, its first worker held after its first part (BATCHINFER_HOLD) while the second starts.
    corpus = tmp_path / "c.jsonl"
    rows = write_corpus(corpus, 400, seed=33)
    base = fault_overrides(corpus, tiny_model_path, max_tokens=24)
    out = tmp_path / "two-workers"
    proc = start_run([*base, f"output.dir={out}"], dict(standin_workload.env, BATCHINFER_HOLD="300"))
    wait_for_part(proc, out)
    res = run_cli(["worker", str(out), "0"], timeout=120)
    assert not RunDir(out).shard_folder(0).is_done()  # the first worker was still writing the shard
    assert res.returncode == 2, res.stderr[-2000:]
    assert f"00000: shard is being written by host {socket.gethostname()} pid {proc.pid}" in res.stderr
    kill_group(proc)
    assert group_alive(proc.pid) == []
    with ShardLock(RunDir(out).shard_dir(0), mode="auto"):  # the kernel dropped the dead holder's lock
        with pytest.raises(RunDirError, match="being written by"):
            with ShardLock(RunDir(out).shard_dir(0), mode="auto"):
                pass
    run = run_local(compose([*base, f"output.dir={out}"]), engine=standin_workload.engine)
    assert_exactly_once(read_output(run.path), rows)


def test_row_that_kills_the_engine_twice_becomes_an_error_row(
    tmp_path: Path, tiny_model_path: Path, standin_workload: Workload, clean_shm: None
) -> None:
    engine = standin_workload.engine
    corpus = tmp_path / "c.jsonl"
    rows = write_corpus(corpus, 200, seed=31)
    rows[57]["text"] = "quick POISON fox"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base, clean = base_and_clean_run(corpus, tiny_model_path, engine, max_tokens=8)
    out = tmp_path / "poisoned"
    args = ["run", *base, f"output.dir={out}"]
    env = dict(standin_workload.env, BATCHINFER_POISON="POISON")
    progress = out / "shards" / "00000" / "progress.json"
    first = run_cli(args, env=env)
    assert first.returncode == 1, first.stderr[-3000:]
    assert "shard 0 failed: " in first.stderr and "Committed rows are safe" in first.stderr
    suspects = json.loads(progress.read_text())["suspects"]
    assert suspects["57"] == 1 and 1 < len(suspects) <= 32  # every row in flight is suspect once
    second = run_cli(args, env=env)  # suspects run one at a time: the engine dies on row 57 alone
    assert second.returncode == 1, second.stderr[-3000:]
    assert "one at a time" in second.stderr
    after = json.loads(progress.read_text())["suspects"]
    assert after["57"] == 2 and all(n == 1 for r, n in after.items() if r != "57")
    third = run_cli(args, env=env)
    assert third.returncode == 0, third.stderr[-3000:]
    got = read_output(out)
    assert [r["id"] for r in got] == [r["id"] for r in rows]
    assert got[57]["error"]["kind"] == "engine_crash" and got[57]["text"] is None
    assert got[57]["error"]["message"].startswith("row 57: the engine died 2 times while this row was in flight")
    assert project(got[:57] + got[58:]) == project(clean[:57] + clean[58:])


STORAGE_SCRIPT = r"""
set -u
mount -t tmpfs -o size=4m tmpfs "$MNT"
# `mount -o remount,ro` refuses (EBUSY) while a file on it is open for writing, as the engine log in
# DIR/logs is; a filesystem the kernel or an NFS server turns read-only does not ask. So here the
# engine logs on the console; the full disk keeps its engine log (its writes fail too).
[ "$MODE" = full ] || export VLLM_LOGGING_LEVEL=WARNING
"$PY" -m batchinfer.cli run "$@" output.dir="$MNT/run" > "$OUT/first.log" 2>&1 &
pid=$!
for i in $(seq 3000); do ls "$MNT"/run/shards/*/part-* > /dev/null 2>&1 && break; sleep 0.1; done
if [ "$MODE" = full ]; then
  dd if=/dev/zero of="$MNT/filler" bs=4k > /dev/null 2>&1
else
  mount -o remount,ro "$MNT" || echo "remount failed" > "$OUT/remount.err"
fi
wait $pid; echo $? > "$OUT/first.rc"
cp -a "$MNT/run" "$OUT/after"
if [ "$MODE" = full ]; then rm "$MNT/filler"; else mount -o remount,rw "$MNT"; fi
"$PY" -m batchinfer.cli run "$@" output.dir="$MNT/run" > "$OUT/second.log" 2>&1; echo $? > "$OUT/second.rc"
cp -a "$MNT/run" "$OUT/final"
"""


def part_hashes(run_dir: Path) -> dict[str, str]:
    """Committed parts and their content hashes."""
    return {
        str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run_dir.glob("shards/*/part-*"))
    }


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("full", "the disk is full (No space left on device)"),
        ("readonly", "the filesystem is read-only (Read-only file system)"),
    ],
)
def test_full_or_read_only_disk_while_committing(
    tmp_path: Path, tiny_model_path: Path, standin_workload: Workload, mode: str, message: str, clean_shm: None
) -> None:
    """As root chmod does not stop writes: a small tmpfs in a private mount namespace does."""
    engine = standin_workload.engine
    corpus = tmp_path / "c.jsonl"
    rows = write_corpus(corpus, 1500, seed=32)
    base, clean = base_and_clean_run(corpus, tiny_model_path, engine, max_tokens=24)
    mnt, out = tmp_path / "mnt", tmp_path / "out"
    mnt.mkdir()
    out.mkdir()
    env = {"MNT": str(mnt), "OUT": str(out), "PY": sys.executable, "MODE": mode}
    res = subprocess.run(
        ["unshare", "-m", "bash", "-c", STORAGE_SCRIPT, "bash", *base],
        env=dict(standin_workload.env, **env),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert not (out / "remount.err").exists()
    first_log = (out / "first.log").read_text()
    assert (out / "first.rc").read_text().strip() == "1", first_log[-3000:]
    assert f"batchinfer: error: cannot write {mnt}/run/" in first_log and message in first_log, first_log[-3000:]
    assert "Nothing already committed was changed" in first_log
    after = part_hashes(out / "after")
    before = committed_rows(out / "after")
    committed = committed_parts_are_whole(out / "after")
    assert after and committed < len(rows)
    assert (out / "second.rc").read_text().strip() == "0", (out / "second.log").read_text()[-3000:]
    final = out / "final"
    # the rows committed before the disk filled are untouched (the finished shard holds them compacted)
    assert {r: v for r, v in committed_rows(final).items() if r in before} == before
    got = read_output(final)
    assert_exactly_once(got, rows)
    assert project(got) == project(clean)
