"""Shard and merge locks on cluster filesystems (issue 13): flock as NFS and Lustre answer it,
node-local flock, and the lock-file fallback with its holder judged by Slurm."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from support.corpus import read_output
from support.fake_engine import FakeEngine, keyed, prepared
from support.filesystems import emulate

from batchinfer.config.compose import compose
from batchinfer.config.fingerprint import fingerprint_keys
from batchinfer.config.schema import to_dict
from batchinfer.errors import ConfigError, RunDirError
from batchinfer.launch.local import run_shards
from batchinfer.rundir import locks
from batchinfer.rundir import merge as merge_mod
from batchinfer.rundir.locks import RunLock, ShardLock
from batchinfer.rundir.merge import merge
from batchinfer.rundir.store import RunDir


@pytest.fixture(autouse=True)
def _no_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests set the Slurm job id they mean; the real one (CI inside a job) must not leak in."""
    for var in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(locks, "_logged", set())


def fake_squeue(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> None:
    """An `squeue` on PATH running the given shell body."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "squeue"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def dead_pid() -> int:
    """A pid that no longer runs."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def write_holder(path: Path, **record: Any) -> bytes:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps(record).encode()
    path.write_bytes(data)
    return data


# ---------------------------------------------------------------- flock as filesystems answer it


def test_flock_through_a_descriptor_nfs_accepts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    emulate(monkeypatch, "nfs")
    d = tmp_path / "shards" / "00000"
    with ShardLock(d, mode="auto") as held:
        assert held.fd is not None and held.excl is None  # flock itself, no fallback
        with pytest.raises(RunDirError, match=rf"00000: shard is being written by host \S+ pid {os.getpid()}"):
            with ShardLock(d, mode="auto"):
                pass
    assert json.loads((d / "lock").read_text())["released"] is True  # the flock file stays
    assert not (d / "lock.excl").exists()
    with ShardLock(d, mode="auto"):
        pass


@pytest.mark.parametrize("mode", ["enosys", "enolck"])
def test_flock_unsupported_falls_back_to_a_lock_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    emulate(monkeypatch, mode)
    d = tmp_path / "shards" / "00003"
    said: list[str] = []
    with ShardLock(d, log=said.append) as held:
        assert held.excl is not None
        record = json.loads((d / "lock.excl").read_text())
        assert record["pid"] == os.getpid() and record["nonce"]
        with pytest.raises(RunDirError, match=rf"00003: shard is being written by host \S+ pid {os.getpid()}"):
            with ShardLock(d, log=said.append):
                pass
    assert not (d / "lock.excl").exists()
    assert said == [
        f"locks: flock unsupported on this filesystem ({mode.upper()}: {os.strerror(getattr(errno, mode.upper()))}); using lock files"
    ]
    with ShardLock(d, log=said.append):  # released: free again
        pass
    assert len(said) == 1  # said once per process
    assert sorted(p.name for p in d.iterdir()) == ["lock"]


MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
40 22 0:40 / {mount} rw,relatime shared:7 - {fstype} {source} {options}
41 40 0:41 / {mount}/other rw - ext4 /dev/sdb1 rw
"""


@pytest.mark.parametrize(
    "fstype, options, why",
    [
        ("lustre", "rw,localflock,lazystatfs", "Lustre mounted localflock"),
        ("nfs4", "rw,vers=4.2,local_lock=flock,addr=10.0.0.1", "NFS mounted local_lock=flock"),
        ("nfs", "rw,vers=3,local_lock=all,addr=10.0.0.1", "NFS mounted local_lock=all"),
        ("nfs", "rw,vers=3,nolock,addr=10.0.0.1", "NFS mounted nolock"),
        ("lustre", "rw,flock,lazystatfs", None),
        ("nfs4", "rw,vers=4.2,local_lock=none", None),
    ],
)
def test_node_local_flock_is_detected_and_uses_lock_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fstype: str, options: str, why: str | None
) -> None:
    mount = tmp_path.resolve() / "scratch"
    info = tmp_path / "mountinfo"
    info.write_text(MOUNTINFO.format(mount=mount, fstype=fstype, source="srv:/export", options=options))
    monkeypatch.setattr(locks, "MOUNTINFO", str(info))
    d = mount / "run" / "shards" / "00000"
    assert locks.node_local_flock(mount / "other" / "x") is None  # the longest mount point decides
    said: list[str] = []
    with ShardLock(d, log=said.append) as held:
        if why:
            assert held.excl is not None and (d / "lock.excl").exists()
            assert said == [f"locks: {mount} is {why}: flock there locks only within one node; using lock files"]
        else:
            assert held.fd is not None and not (d / "lock.excl").exists() and said == []


def test_output_lock_setting_forces_the_mode_and_stays_out_of_the_fingerprint(tmp_path: Path) -> None:
    run = prepared(tmp_path, 4, "output.lock=file")
    assert run.run["config"]["output"]["lock"] == "file"
    assert not any(k.startswith("output.lock") for k in run.run["fingerprint_keys"])
    assert "output.lock" not in fingerprint_keys(to_dict(compose(["output.lock=flock"])), "x")
    with ShardLock(run.shard_dir(0)) as held:  # the mode comes from DIR/run.yaml
        assert held.excl is not None
    with pytest.raises(ConfigError, match="output.lock='nfs' is not one of: auto, flock, file"):
        compose(["output.lock=nfs"])


def test_flock_still_refuses_a_live_holder_recorded_on_another_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_squeue(tmp_path, monkeypatch, "echo RUNNING")
    d = tmp_path / "shards" / "00000"
    before = write_holder(d / "lock", host="other-node", pid=7, slurm_job="777_1", since=1.0, nonce="n")
    with pytest.raises(RunDirError, match=r"being written by host other-node pid 7, Slurm job 777_1 \(Slurm: RUNNING"):
        with ShardLock(d, mode="flock"):
            pass
    assert (d / "lock").read_bytes() == before
    write_holder(d / "lock", host="other-node", pid=7, slurm_job="777_1", released=True)
    with ShardLock(d, mode="flock"):  # a clean release says so
        pass


def test_the_two_modes_see_each_other(tmp_path: Path) -> None:
    d = tmp_path / "shards" / "00000"
    with ShardLock(d, mode="flock"):  # a node that took flock: a lock-file node refuses
        with pytest.raises(RunDirError, match=rf"pid {os.getpid()} \(flock mode\)"):
            with ShardLock(d, mode="file"):
                pass
        assert not (d / "lock.excl").exists()
    with ShardLock(d, mode="file"):  # and the other way round
        with pytest.raises(RunDirError, match=rf"pid {os.getpid()} \(lock-file mode\)"):
            with ShardLock(d, mode="flock"):
                pass
    with ShardLock(d, mode="flock"), pytest.raises(RunDirError):
        with ShardLock(d, mode="flock"):
            pass


# ---------------------------------------------------------------- the lock-file fallback


def test_requeued_task_takes_its_own_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_squeue(tmp_path, monkeypatch, "echo RUNNING")  # Slurm shows the requeued task running
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    d = tmp_path / "shards" / "00003"
    first = ShardLock(d, mode="file").__enter__()  # then killed: never released
    assert json.loads((d / "lock.excl").read_text())["slurm_job"] == "4242_3"
    with ShardLock(d, mode="file") as again:  # the same task after its requeue
        assert json.loads((d / "lock.excl").read_text())["nonce"] == again.excl.nonce  # type: ignore[union-attr]
        monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "4")  # another task of the array is foreign
        with pytest.raises(RunDirError, match=r"being written by host \S+ pid \d+, Slurm job 4242_3"):
            with ShardLock(d, mode="file"):
                pass
        monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
        first.__exit__()  # the old incarnation's release does not remove the new holder's lock
        assert json.loads((d / "lock.excl").read_text())["nonce"] == again.excl.nonce  # type: ignore[union-attr]
    assert not (d / "lock.excl").exists()


def test_empty_lock_file_is_stale_only_when_old(tmp_path: Path) -> None:
    d = tmp_path / "shards" / "00000"
    d.mkdir(parents=True)
    (d / "lock.excl").write_bytes(b"")  # an older writer killed between create and write
    with pytest.raises(RunDirError, match=r"empty or unreadable, \d+ s old; it counts as stale after 300 s"):
        with ShardLock(d, mode="file"):
            pass
    old = os.stat(d / "lock.excl").st_mtime - locks.LOCK_UNREADABLE_STALE_S - 5
    os.utime(d / "lock.excl", (old, old))
    with ShardLock(d, mode="file") as held:
        assert json.loads((d / "lock.excl").read_text())["nonce"] == held.excl.nonce  # type: ignore[union-attr]


def test_squeue_failing_keeps_the_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_squeue(tmp_path, monkeypatch, "echo 'slurm_load_jobs error: Unable to contact slurm controller' >&2; exit 1")
    d = tmp_path / "shards" / "00000"
    before = write_holder(d / "lock.excl", host="n1", pid=5, slurm_job="88", since=1.0, nonce="abc")
    with pytest.raises(RunDirError) as e:
        with ShardLock(d, mode="file"):
            pass
    assert "being written by host n1 pid 5, Slurm job 88; Slurm did not answer" in str(e.value)
    assert "Unable to contact slurm controller" in str(e.value) and "the lock is kept, never stolen" in str(e.value)
    assert (d / "lock.excl").read_bytes() == before
    assert sorted(p.name for p in d.iterdir()) == ["lock.excl"]


def test_squeue_hanging_is_refused_within_the_timeout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_squeue(tmp_path, monkeypatch, "exec sleep 60")
    monkeypatch.setattr(locks, "SQUEUE_TIMEOUT_S", 1.0)
    d = tmp_path / "shards" / "00000"
    before = write_holder(d / "lock.excl", host="n1", pid=5, slurm_job="88", since=1.0, nonce="abc")
    t0 = time.monotonic()
    with pytest.raises(RunDirError, match=r"Slurm did not answer \(squeue did not answer within 1 s\)"):
        with ShardLock(d, mode="file"):
            pass
    assert time.monotonic() - t0 < 10
    assert (d / "lock.excl").read_bytes() == before


def test_purged_job_is_dead_and_its_lock_taken_over(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_squeue(tmp_path, monkeypatch, "echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1")
    d = tmp_path / "shards" / "00000"
    write_holder(d / "lock.excl", host="n1", pid=5, slurm_job="88", since=1.0, nonce="abc")
    said: list[str] = []
    with ShardLock(d, mode="file", log=said.append):
        assert json.loads((d / "lock.excl").read_text())["pid"] == os.getpid()
    assert any("taking over the stale lock of host n1 pid 5, Slurm job 88" in s for s in said)
    assert sorted(p.name for p in d.iterdir()) == []  # no marker, no temporary left


def test_holder_on_another_host_without_slurm_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "shards" / "00000"
    write_holder(d / "lock.excl", host="elsewhere", pid=5, slurm_job=None, since=1.0, nonce="abc")
    with pytest.raises(RunDirError, match=r"host elsewhere pid 5 \(on another host .* remove .*lock.excl by hand"):
        with ShardLock(d, mode="file"):
            pass


def _stale(d: Path) -> str:
    write_holder(d / "lock.excl", host=socket.gethostname(), pid=dead_pid(), slurm_job=None, nonce="stale1")
    return "stale1"


def test_two_takers_of_one_stale_lock_one_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = tmp_path / "shards" / "00000"
    key = _stale(d)
    path = d / "lock.excl"
    a = locks._ExclFile(path, lambda who: RunDirError(f"held by {who}"), print)
    b = locks._ExclFile(path, lambda who: RunDirError(f"held by {who}"), print)
    refused: list[str] = []

    def b_meanwhile() -> None:  # b found the same stale lock and tries while a holds the claim
        try:
            b.takeover(key)
        except RunDirError as e:
            refused.append(str(e))

    monkeypatch.setattr(locks, "_after_claim", b_meanwhile)
    assert a.takeover(key) is True
    monkeypatch.undo()
    assert refused and f"pid {os.getpid()}" in refused[0]  # a's claim, alive
    assert b.takeover(key) is False  # later: the lock no longer carries the stale key
    assert json.loads(path.read_text())["nonce"] == a.nonce
    with pytest.raises(RunDirError, match=f"pid {os.getpid()}"):
        b.acquire()
    b.release()  # not b's: kept
    assert json.loads(path.read_text())["nonce"] == a.nonce
    assert sorted(p.name for p in d.iterdir()) == ["lock.excl"]


def test_a_taker_that_died_holding_its_claim_does_not_block_forever(tmp_path: Path) -> None:
    d = tmp_path / "shards" / "00000"
    key = _stale(d)
    dead = {"host": socket.gethostname(), "pid": dead_pid(), "slurm_job": None, "nonce": "t1"}
    write_holder(d / f"lock.excl.takeover-{key}-1", **dead)
    with ShardLock(d, mode="file") as held:
        assert json.loads((d / "lock.excl").read_text())["nonce"] == held.excl.nonce  # type: ignore[union-attr]
    assert (d / f"lock.excl.takeover-{key}-1").exists()  # young: left for a later clean-up


def test_a_lock_file_is_never_empty_at_its_name(tmp_path: Path) -> None:
    d = tmp_path / "shards" / "00000"
    code = (
        "import os, signal, sys\n"
        "from pathlib import Path\n"
        "from batchinfer.rundir import locks\n"
        "locks.os.link = lambda *a: os.kill(os.getpid(), signal.SIGKILL)\n"
        f"locks.ShardLock(Path({str(d)!r}), mode='file').__enter__()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert not (d / "lock.excl").exists()
    (leftover,) = d.glob("lock.excl.new-*")
    record = json.loads(leftover.read_text())  # a whole record, only never at the lock's name
    assert record["host"] == socket.gethostname() and record["nonce"]
    old = os.stat(leftover).st_mtime - locks.LOCK_UNREADABLE_STALE_S - 5
    os.utime(leftover, (old, old))
    with ShardLock(d, mode="file"):
        assert not leftover.exists()  # killed contenders' leftovers go once old


# ---------------------------------------------------------------- one merge at a time


def _finished(tmp_path: Path, *extra: str) -> RunDir:
    run = prepared(tmp_path, 12, "sharding.num_shards=2", *extra)
    run_shards(run, [0, 1], engine=keyed(FakeEngine(), run))
    assert run.is_done(0) and run.is_done(1)
    return run


@pytest.mark.parametrize("mode", ["auto", "file"])
def test_two_merges_at_once_one_writes_the_other_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    run = _finished(tmp_path, f"output.lock={mode}")
    (run.path / ".tmp-output.parquet").write_bytes(b"half of a killed merge")  # an older version's name
    (run.path / ".tmp-h-1-abc-output.parquet").write_bytes(b"half of a killed merge")
    (run.path / ".tmp-h-1-abc-output.parquet-cache").mkdir()
    inside, go = threading.Event(), threading.Event()
    real = merge_mod.shard_rows_in_order

    def slow(r: RunDir, shard: Any) -> pa.Table:
        if shard.index == 1:  # shard 0 is in the first merge's temporary file by now
            inside.set()
            assert go.wait(30)
        return real(r, shard)

    monkeypatch.setattr(merge_mod, "shard_rows_in_order", slow)
    results: list[Any] = []
    first = threading.Thread(target=lambda: results.append(merge(run)))
    first.start()
    assert inside.wait(30)
    temporaries = sorted(p.name for p in run.path.glob(".tmp-*"))
    (mine,) = temporaries  # the first merge's own, unique name; leftovers were removed under the lock
    assert mine.startswith(f".tmp-{socket.gethostname()}-{os.getpid()}-") and mine.endswith("-output.parquet")
    with pytest.raises(RunDirError, match=rf"{run.path} is being merged by host \S+ pid {os.getpid()}"):
        merge(run)
    assert sorted(p.name for p in run.path.glob(".tmp-*")) == temporaries  # the refused one touched nothing
    go.set()
    first.join(60)
    assert results and results[0]["rows"] == 12
    assert [r["row"] for r in read_output(run.path)] == list(range(12))
    assert not list(run.path.glob(".tmp-*"))
    monkeypatch.undo()
    assert merge(run)["rows"] == 12  # released: a later merge runs


def test_merge_lock_in_another_process_refuses(tmp_path: Path) -> None:
    run = _finished(tmp_path)
    code = (
        "import sys, time\nfrom pathlib import Path\nfrom batchinfer.rundir.locks import RunLock\n"
        f"with RunLock(Path({str(run.path)!r})):\n    print('held', flush=True)\n    sys.stdin.read()\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"  # type: ignore[union-attr]
        with pytest.raises(RunDirError, match=rf"is being merged by host \S+ pid {holder.pid}"):
            merge(run)
        assert not run.output_path.exists()
    finally:
        holder.communicate("", timeout=30)
    assert merge(run)["rows"] == 12
    with RunLock(run.path):
        pass


@pytest.mark.parametrize("mode", ["enosys", "enolck"])
def test_input_converts_where_flock_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    # datasets file-locks its conversion cache: in DIR that would fail before any shard runs.
    emulate(monkeypatch, mode, str(tmp_path / "run"))
    run = prepared(tmp_path, 7)
    assert run.shards()[0].rows == 7 and not (run.path / ".hf-cache").exists()
    assert [p.name for p in run.path.iterdir() if p.name.startswith(".flock-probe")] == []
