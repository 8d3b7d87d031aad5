"""Shard and merge locks on cluster filesystems (issues 13, 27): flock as NFS (POSIX record locks)
and Lustre answer it, node-local flock, mixed modes, and the lock-file fallback with its holder
judged by its pid on this machine, by its Slurm job (on its own cluster) or by its run of our
own job."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import pytest
from support.corpus import read_output
from support.fake_engine import FakeEngine, keyed, prepared
from support.filesystems import emulate, emulation_env, logged_calls

from batchinfer import locks
from batchinfer.config.compose import compose
from batchinfer.config.fingerprint import fingerprint_keys
from batchinfer.config.schema import to_dict
from batchinfer.errors import ConfigError, RunDirError, TransientRunDirError
from batchinfer.launch.local import run_shards
from batchinfer.locks import Holder, RunLock, ShardLock, Verdict, configured_mode
from batchinfer.locks import filesystems as fs_mod
from batchinfer.locks import holder as holder_mod
from batchinfer.locks import judge as judge_mod
from batchinfer.locks import lock as lock_mod
from batchinfer.locks import lockfile as lockfile_mod
from batchinfer.locks import mode as mode_mod
from batchinfer.rundir import merge as merge_mod
from batchinfer.rundir.merge import merge
from batchinfer.rundir.store import RunDir

SLURM_VARS = (
    "SLURM_JOB_ID",
    "SLURM_ARRAY_JOB_ID",
    "SLURM_ARRAY_TASK_ID",
    "SLURM_RESTART_COUNT",
    "SLURM_CLUSTER_NAME",
)


@pytest.fixture(autouse=True)
def _no_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests set the Slurm job they mean; the real one (CI inside a job) must not leak in."""
    for var in SLURM_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(lock_mod, "_logged", set())


def in_job(
    monkeypatch: pytest.MonkeyPatch, array: str = "4242", task: str = "3", restart: int = 0, **more: str
) -> None:
    """This process as array task array_task of a Slurm job, in its run `restart`."""
    monkeypatch.setenv("SLURM_JOB_ID", str(int(array) + int(task) + 1))
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", array)
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", task)
    monkeypatch.setenv("SLURM_RESTART_COUNT", str(restart))
    for k, v in more.items():
        monkeypatch.setenv(k, v)


def fake_squeue(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str, name: str = "squeue") -> Path:
    """An `squeue` (or another command) on PATH running the given shell body; its arguments are
    appended to the returned file, one call a line."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    calls = bin_dir / f"{name}.calls"
    script = bin_dir / name
    script.write_text(f'#!/bin/sh\necho "$@" >> "{calls}"\n{body}\n')
    script.chmod(0o755)
    if str(bin_dir) not in os.environ["PATH"].split(os.pathsep):
        monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return calls


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


# A process that takes a shard lock, says "held" (or "refused <why>") and keeps it until its stdin closes.
HOLD = """\
import sys
from pathlib import Path
from batchinfer.errors import RunDirError
from batchinfer.locks import ShardLock
try:
    lock = ShardLock(Path(sys.argv[1]), log=lambda m: None, mode=sys.argv[2]).__enter__()
except RunDirError as e:
    print("refused " + str(e), flush=True)
    sys.exit(0)
print("held", flush=True)
sys.stdin.read()
lock.__exit__(None, None, None)
"""


@contextmanager
def holding(d: Path, mode: str, env: Optional[dict[str, str]] = None) -> Iterator[tuple[str, int]]:
    """Another process trying shard lock d: ("held" or "refused <why>", its pid) while it holds."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(d), mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        yield proc.stdout.readline().strip(), proc.pid  # type: ignore[union-attr]
    finally:
        proc.communicate("", timeout=60)
    assert proc.returncode == 0


def try_lock(d: Path, mode: str, env: Optional[dict[str, str]] = None) -> str:
    """Another process's answer to taking shard lock d: "held" or "refused <why>" (then released)."""
    with holding(d, mode, env) as (answer, _):
        return answer


# ---------------------------------------------------------------- flock as filesystems answer it

# Another process taking flock on a file as the NFS emulation answers it: "locked" or "blocked";
# argv: a path, or "fd:N" to use the inherited descriptor N.
TRY_FLOCK = """\
import fcntl, os, sys
fd = int(sys.argv[1][3:]) if sys.argv[1].startswith("fd:") else os.open(sys.argv[1], os.O_RDWR)
try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    print("locked")
except BlockingIOError:
    print("blocked")
"""


def other_process_flock(target: str, env: dict[str, str], fd: Optional[int] = None) -> str:
    """What another process gets from flock on a path, or on our descriptor fd, inherited."""
    args, kw = ([f"fd:{fd}"], dict(pass_fds=(fd,))) if fd is not None else ([target], {})
    out = subprocess.run([sys.executable, "-c", TRY_FLOCK, *args], env=env, capture_output=True, text=True, **kw)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_nfs_emulation_has_posix_record_lock_semantics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The emulation the NFS tests run on: flock as POSIX record locks, checked on what tells them
    apart from flock (every line below answers the other way with the real flock)."""
    seen = emulate(monkeypatch, "nfs", tmp_path)
    log = tmp_path / "flock.log"
    env = emulation_env("nfs", tmp_path, log)
    f = tmp_path / "f"
    f.write_bytes(b"")
    read_only = os.open(f, os.O_RDONLY)
    with pytest.raises(OSError) as e:  # an exclusive lock needs a descriptor open for writing
        fcntl.flock(read_only, fcntl.LOCK_EX | fcntl.LOCK_NB)
    assert e.value.errno == errno.EBADF
    os.close(read_only)
    first, second = os.open(f, os.O_RDWR), os.open(f, os.O_RDWR)
    fcntl.flock(first, fcntl.LOCK_EX | fcntl.LOCK_NB)
    fcntl.flock(second, fcntl.LOCK_EX | fcntl.LOCK_NB)  # per process: granted again
    assert other_process_flock(str(f), env) == "blocked"
    os.close(second)  # closing ANY descriptor of the file drops the process's lock
    assert other_process_flock(str(f), env) == "locked"
    fcntl.flock(first, fcntl.LOCK_EX | fcntl.LOCK_NB)
    assert other_process_flock("", env, fd=first) == "blocked"  # a child's inherited descriptor holds nothing
    os.close(first)
    assert [(m, p) for m, p, _ in seen.calls] == [("nfs", str(f))] * 4  # in force, on the file meant
    assert {(mode, op, path) for _, mode, op, path in logged_calls(log)} == {("nfs", "LOCK_EX|LOCK_NB", str(f))}
    assert len({pid for pid, *_ in logged_calls(log)}) == 3  # and in each subprocess


def test_flock_through_a_descriptor_nfs_accepts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = emulate(monkeypatch, "nfs", tmp_path)
    log = tmp_path / "flock.log"
    env = emulation_env("nfs", tmp_path, log)
    d = tmp_path / "shards" / "00000"
    with ShardLock(d, mode="auto") as held:
        assert held.fd is not None and held.excl is None  # flock itself, no fallback
        answer = try_lock(d, "auto", env)
        assert answer.startswith(
            f"refused 00000: shard is being written by host {socket.gethostname()} pid {os.getpid()}"
        )
        # A second lock of the name in this process is refused before it opens the file: POSIX
        # locks would grant it, and closing its descriptor would drop the first one's lock.
        with pytest.raises(RunDirError, match=rf"pid {os.getpid()} \(this same process\)"):
            with ShardLock(d, mode="auto"):
                pass
        assert try_lock(d, "auto", env).startswith("refused")  # so the first still holds
        assert (str(d / "lock"), "LOCK_EX|LOCK_NB") in {(p, op) for _, p, op in seen.calls}
    assert json.loads((d / "lock").read_text())["released"] is True  # the flock file stays
    assert not (d / "lock.excl").exists()
    assert try_lock(d, "auto", env) == "held"
    assert {p for *_, p in logged_calls(log)} == {str(d / "lock")}  # the other processes were emulated too


@pytest.mark.parametrize("mode", ["enosys", "enolck"])
def test_flock_unsupported_falls_back_to_a_lock_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    seen = emulate(monkeypatch, mode)
    d = tmp_path / "shards" / "00003"
    said: list[str] = []
    with ShardLock(d, mode="auto", log=said.append) as held:
        assert held.excl is not None
        record = json.loads((d / "lock.excl").read_text())
        assert record["pid"] == os.getpid() and record["nonce"]
        with pytest.raises(RunDirError, match=rf"00003: shard is being written by host \S+ pid {os.getpid()}"):
            with ShardLock(d, mode="auto", log=said.append):
                pass
    assert not (d / "lock.excl").exists()
    assert said == [
        f"locks: flock unsupported on this filesystem ({mode.upper()}: {os.strerror(getattr(errno, mode.upper()))}); using lock files"
    ]
    assert seen.paths() == {str(d / "lock")}  # the emulation answered, on the shard's lock
    with ShardLock(d, mode="auto", log=said.append):  # released: free again
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
        ("beegfs", "rw,cfgFile={cfg_default}", "BeeGFS without tuneUseGlobalFileLocks"),
        ("beegfs", "rw,cfgFile={cfg_global}", None),
        ("beegfs", "rw,cfgFile={cfg_default},tuneUseGlobalFileLocks=true", None),
        ("beegfs", "rw,cfgFile=/nonexistent/beegfs-client.conf", "BeeGFS without tuneUseGlobalFileLocks"),
        ("lustre", "rw,flock,lazystatfs", None),
        ("nfs4", "rw,vers=4.2,local_lock=none", None),
    ],
)
def test_node_local_flock_is_detected_and_uses_lock_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fstype: str, options: str, why: str | None
) -> None:
    mount = tmp_path.resolve() / "scratch"
    cfg_default, cfg_global = tmp_path / "default.conf", tmp_path / "global.conf"
    cfg_default.write_text("sysMgmtdHost = mgmt\ntuneUseGlobalFileLocks        = false # the default\n")
    cfg_global.write_text("sysMgmtdHost = mgmt\ntuneUseGlobalFileLocks = true\n")
    options = options.format(cfg_default=cfg_default, cfg_global=cfg_global)
    info = tmp_path / "mountinfo"
    info.write_text(MOUNTINFO.format(mount=mount, fstype=fstype, source="srv:/export", options=options))
    monkeypatch.setattr(fs_mod, "MOUNTINFO", str(info))
    d = mount / "run" / "shards" / "00000"
    assert locks.node_local_flock(mount / "other" / "x") is None  # the longest mount point decides
    said: list[str] = []
    with ShardLock(d, mode="auto", log=said.append) as held:
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
    with ShardLock(run.shard_dir(0), mode=configured_mode(run.path)) as held:  # the mode comes from DIR/run.yaml
        assert held.excl is not None
    with pytest.raises(ConfigError, match="output.lock='nfs' is not one of: auto, flock, file"):
        compose(["output.lock=nfs"])


def test_a_run_yaml_that_cannot_be_read_now_is_not_taken_for_auto(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = prepared(tmp_path, 4, "output.lock=file")
    monkeypatch.setattr(mode_mod, "RUN_YAML_RETRY_WAITS", (0.0, 0.0), raising=False)
    run_yaml = run.path / "run.yaml"
    real_read = Path.read_text
    failures = {"left": 1}

    def flaky(self: Path, *a: Any, **kw: Any) -> str:
        if self == run_yaml and failures["left"] > 0:
            failures["left"] -= 1
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(self))
        return real_read(self, *a, **kw)

    monkeypatch.setattr(Path, "read_text", flaky)
    with ShardLock(
        run.shard_dir(0), mode=configured_mode(run.path)
    ) as held:  # read again: lock files, as configured, not flock
        assert held.excl is not None and failures["left"] == 0
    failures["left"] = 3  # it stays unreadable: refused, naming the file
    with pytest.raises(RunDirError, match=rf"{run_yaml}: it cannot be read: Input/output error") as e:
        with ShardLock(run.shard_dir(0), mode=configured_mode(run.path)):
            pass
    assert isinstance(e.value, TransientRunDirError)
    assert not (run.shard_dir(0) / "lock").exists() and not (run.shard_dir(0) / "lock.excl").exists()
    monkeypatch.undo()
    good = run_yaml.read_text()
    run_yaml.write_text(good[: len(good) // 2] + "\n  [unclosed")
    with pytest.raises(RunDirError, match=rf"{run_yaml}: it is not valid YAML"):
        with ShardLock(run.shard_dir(0), mode=configured_mode(run.path)):
            pass


def test_the_lock_takes_its_mode_from_the_caller_and_the_worker_reads_run_yaml_at_each_shard(
    tmp_path: Path,
) -> None:
    """A lock never reads run.yaml (issue 28): its caller passes the mode. The worker reads
    output.lock from run.yaml afresh for each shard, so a resume that changed it (run.yaml
    rewritten while a task runs) decides the next shard's mechanism."""
    run = prepared(tmp_path, 8, "sharding.num_shards=2", "output.lock=file")
    with pytest.raises(TypeError, match="mode"):
        ShardLock(run.shard_dir(0))  # type: ignore[call-arg]
    with ShardLock(run.shard_dir(0), mode="flock") as held:  # the caller's mode, whatever run.yaml says
        assert held.fd is not None and held.excl is None
    (run.shard_dir(0) / "lock").unlink()
    run_shards(run, [0], engine=keyed(FakeEngine(), run))
    assert run.shard_folder(0).is_done() and not (run.shard_dir(0) / "lock").exists()  # lock files, as configured
    resumed = RunDir(run.path)
    record = resumed.run
    record["config"]["output"]["lock"] = "flock"
    resumed.write_run(record)  # as a resume does; `run` keeps its own cached config
    assert run.config.output.lock == "file"
    run_shards(run, [1], engine=keyed(FakeEngine(), run))
    assert run.shard_folder(1).is_done() and json.loads((run.shard_dir(1) / "lock").read_text())["released"] is True


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


def test_flock_refuses_a_live_process_of_its_own_job_and_run_on_another_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # srun -n2 on two nodes, or members of one task, where flock is node-local without saying so.
    in_job(monkeypatch)
    d = tmp_path / "shards" / "00003"
    record = dict(host="other-node", pid=7, slurm_job="4242_3", slurm_restart=0, since=1.0, nonce="n")
    before = write_holder(d / "lock", **record)
    with pytest.raises(RunDirError, match=r"Slurm job 4242_3 \(a live process of this same Slurm job and run"):
        with ShardLock(d, mode="flock"):
            pass
    assert (d / "lock").read_bytes() == before
    in_job(monkeypatch, restart=1)  # requeued: that run is over
    with ShardLock(d, mode="flock") as held:
        assert json.loads((d / "lock").read_text())["nonce"] == held.nonce


def test_the_two_modes_see_each_other(tmp_path: Path) -> None:
    d = tmp_path / "shards" / "00000"
    with holding(d, "flock") as (answer, pid):  # a node that took flock: a lock-file node refuses
        assert answer == "held"
        with pytest.raises(RunDirError, match=rf"pid {pid} \(flock mode\) \(process running\)"):
            with ShardLock(d, mode="file"):
                pass
        assert not (d / "lock.excl").exists()
    with holding(d, "file") as (answer, pid):  # and the other way round
        assert answer == "held"
        with pytest.raises(RunDirError, match=rf"pid {pid} \(lock-file mode\) \(process running\)"):
            with ShardLock(d, mode="flock"):
                pass
        assert json.loads((d / "lock").read_text())["released"] is True  # ours, published then withdrawn
    with ShardLock(d, mode="flock"):
        assert try_lock(d, "flock").startswith("refused")


def test_flock_publishes_its_record_before_looking_at_the_lock_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flock process and a lock-file process at once: each publishes before it looks at the
    other's mechanism, so at most one holds, whatever the interleaving. Here the lock-file
    process runs all of its steps just after the flock process looked for a lock file."""
    d = tmp_path / "shards" / "00000"
    real_read = lock_mod.read_holder
    other: list[Any] = []

    def then_the_other_process(path: Path) -> Any:
        seen = real_read(path)
        if path.name == "lock.excl" and not other:
            ctx = holding(d, "file")
            other.append((ctx, ctx.__enter__()[0]))
        return seen

    monkeypatch.setattr(lock_mod, "read_holder", then_the_other_process)
    try:
        with ShardLock(d, mode="flock"):
            mine = "held"
    except RunDirError as e:
        mine = f"refused {e}"
    finally:
        for ctx, _ in other:
            ctx.__exit__(None, None, None)
    (theirs,) = [answer for _, answer in other]
    assert sorted(a.split(" ")[0] for a in (mine, theirs)) == ["held", "refused"]
    assert theirs.endswith(f"pid {os.getpid()} (flock mode) (process running); wait for it or cancel it")


def test_flock_gives_way_to_a_node_that_wrote_over_its_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Silently node-local flock (BeeGFS by default): another node was granted flock too and
    wrote its record after ours; we re-read it and give way, leaving its record."""
    fake_squeue(tmp_path, monkeypatch, "exit 0")  # job 99 has ended by the time the lock is free
    d = tmp_path / "shards" / "00000"
    theirs = dict(host="other-node", pid=7, slurm_job="99", since=2.0, nonce="theirs")
    monkeypatch.setattr(lock_mod, "_after_publish", lambda: write_holder(d / "lock", **theirs), raising=False)
    with pytest.raises(RunDirError, match=r"host other-node pid 7, Slurm job 99 \(it wrote its record over ours"):
        with ShardLock(d, mode="flock"):
            pass
    assert json.loads((d / "lock").read_text()) == theirs
    assert try_lock(d, "flock") == "held"  # flock itself was let go


# ---------------------------------------------------------------- the lock-file fallback: our own Slurm job


def test_a_live_process_of_our_own_job_keeps_its_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes of one task (srun -n2, members, an salloc shell): same job id, both alive."""
    fake_squeue(tmp_path, monkeypatch, "echo RUNNING")  # Slurm shows our job running, of course
    in_job(monkeypatch)
    d = tmp_path / "shards" / "00003"
    with holding(d, "file") as (answer, pid):  # a live process of our job, on this machine
        assert answer == "held"
        before = (d / "lock.excl").read_bytes()
        assert json.loads(before)["slurm_job"] == "4242_3" and json.loads(before)["slurm_restart"] == 0
        with pytest.raises(RunDirError, match=rf"pid {pid}, Slurm job 4242_3 \(process running\)"):
            with ShardLock(d, mode="file"):
                pass
        in_job(monkeypatch, restart=1)  # even a later run: its process still runs here
        with pytest.raises(RunDirError, match=rf"pid {pid}, Slurm job 4242_3 \(process running\)"):
            with ShardLock(d, mode="file"):
                pass
        assert (d / "lock.excl").read_bytes() == before
    assert not (d / "lock.excl").exists()  # it released its own


def test_our_own_job_on_another_node_is_free_only_after_a_requeue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_squeue(tmp_path, monkeypatch, "echo RUNNING")
    in_job(monkeypatch)
    d = tmp_path / "shards" / "00003"
    record = dict(host="other-node", pid=7, slurm_job="4242_3", since=1.0, nonce="n1")
    before = write_holder(d / "lock.excl", **record, slurm_restart=0)
    with pytest.raises(
        RunDirError,
        match=r"host other-node pid 7, Slurm job 4242_3 \(a live process of this same Slurm job and run \(restart 0\)\)",
    ):
        with ShardLock(d, mode="file"):
            pass
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "4")  # another task of the array: foreign, Slurm says running
    with pytest.raises(RunDirError, match=r"Slurm job 4242_3 \(Slurm: RUNNING\)"):
        with ShardLock(d, mode="file"):
            pass
    assert (d / "lock.excl").read_bytes() == before
    write_holder(d / "lock.excl", **record)  # an older batchinfer's record: no restart count
    in_job(monkeypatch, restart=1)
    with pytest.raises(
        RunDirError,
        match=r"has no restart count: it cannot be checked from here\); if that process is gone, remove .*lock.excl by hand",
    ):
        with ShardLock(d, mode="file"):
            pass
    write_holder(d / "lock.excl", **record, slurm_restart=0)
    said: list[str] = []
    with ShardLock(d, mode="file", log=said.append) as again:  # requeued: the run before ours is over
        assert json.loads((d / "lock.excl").read_text())["nonce"] == again.excl.nonce  # type: ignore[union-attr]
        assert json.loads((d / "lock.excl").read_text())["slurm_restart"] == 1
    assert said[-1].endswith(
        "taking over the stale lock of host other-node pid 7, Slurm job 4242_3 (an earlier run of this Slurm job "
        "(restart 0, this is restart 1): Slurm ended it before requeueing)"
    )
    mine = Holder.mine()
    here = dict(host=mine.host, pid=dead_pid(), boot_id=mine.boot_id, pid_ns=mine.pid_ns)
    write_holder(d / "lock.excl", **dict(record, **here), slurm_restart=1)
    with ShardLock(d, mode="file"):  # the same run, its process gone from this machine
        pass
    assert not (d / "lock.excl").exists()


def test_an_earlier_runs_release_keeps_the_later_runs_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    in_job(monkeypatch)
    path = tmp_path / "shards" / "00003" / "lock.excl"
    path.parent.mkdir(parents=True)
    first = lockfile_mod.ExclFile(path, lambda who: RunDirError(who), print)
    first.acquire()
    record = json.loads(path.read_text())
    write_holder(path, **dict(record, host="failing-node", pid=7))  # as if on a node that failed
    in_job(monkeypatch, restart=1)
    with ShardLock(path.parent, mode="file") as again:
        first.release()  # the old run's late release does not remove the new run's lock
        assert json.loads(path.read_text())["nonce"] == again.excl.nonce  # type: ignore[union-attr]
    assert not path.exists()


def _stale(d: Path) -> str:
    write_holder(d / "lock.excl", host=socket.gethostname(), pid=dead_pid(), slurm_job=None, nonce="stale1")
    return "stale1"


@pytest.mark.parametrize("job", [False, True], ids=["no-slurm", "one-slurm-job"])
def test_two_takers_of_one_stale_lock_one_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, job: bool) -> None:
    if job:  # both takers processes of one Slurm job and run: neither may pass the other's claim
        in_job(monkeypatch)
    d = tmp_path / "shards" / "00000"
    key = _stale(d)
    path = d / "lock.excl"
    a = lockfile_mod.ExclFile(path, lambda who: RunDirError(f"held by {who}"), print)
    b = lockfile_mod.ExclFile(path, lambda who: RunDirError(f"held by {who}"), print)
    refused: list[str] = []

    def b_meanwhile() -> None:  # b found the same stale lock and tries while a holds the claim
        monkeypatch.setattr(lockfile_mod, "_after_claim", lambda: None)
        try:
            b.takeover(key)
        except RunDirError as e:
            refused.append(str(e))

    monkeypatch.setattr(lockfile_mod, "_after_claim", b_meanwhile)
    assert a.takeover(key) is True
    assert refused and refused[0].startswith(
        f"held by host {socket.gethostname()} pid {os.getpid()}"
    )  # a's claim, alive
    assert b.takeover(key) is False  # later: the lock no longer carries the stale key
    assert json.loads(path.read_text())["nonce"] == a.nonce
    with pytest.raises(RunDirError, match=f"pid {os.getpid()}"):
        b.acquire()
    b.release()  # not b's: kept
    assert json.loads(path.read_text())["nonce"] == a.nonce
    assert sorted(p.name for p in d.iterdir()) == ["lock.excl"]


# ---------------------------------------------------------------- judging a holder by its pid


def test_a_pid_is_judged_only_on_its_own_machine_and_run(tmp_path: Path) -> None:
    mine = Holder.mine()
    here = dict(host=mine.host, slurm_job=None, since=1.0, nonce="n", boot_id=mine.boot_id, pid_ns=mine.pid_ns)
    sleeper = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        started = holder_mod.pid_start(sleeper.pid)
        assert started is not None and mine.pid_start == holder_mod.pid_start(os.getpid())
        alive = Holder.from_record(dict(here, pid=sleeper.pid, pid_start=started))
        assert locks.judge_holder(alive) == locks.Judgement(Verdict.ALIVE, "process running")  # type: ignore[arg-type]
        # The pid runs another process than the one that took the lock: reused, the holder is gone.
        reused = Holder.from_record(dict(here, pid=sleeper.pid, pid_start=started - 1))
        judged = locks.judge_holder(reused)  # type: ignore[arg-type]
        assert judged == locks.Judgement(
            Verdict.DEAD, f"pid {sleeper.pid} is now another process, started after the holder"
        )
    finally:
        sleeper.communicate(b"", timeout=30)
    gone = dict(here, pid=dead_pid())
    assert locks.judge_holder(Holder.from_record(gone)).verdict is Verdict.DEAD  # type: ignore[arg-type]
    d = tmp_path / "shards" / "00000"
    # The same host name on another machine (containers) or another pid namespace: the pid
    # means nothing here, and a holder without a Slurm job cannot be judged.
    for other in (dict(boot_id="another-machine"), dict(pid_ns="pid:[1]")):
        before = write_holder(d / "lock.excl", **dict(gone, **other))
        with pytest.raises(RunDirError, match=r"on another host without a Slurm job: it cannot be checked from here"):
            with ShardLock(d, mode="file"):
                pass
        assert (d / "lock.excl").read_bytes() == before


# ---------------------------------------------------------------- judging a holder by Slurm


def test_a_holder_on_another_cluster_is_asked_there(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_squeue(
        tmp_path,
        monkeypatch,
        'case "$*" in "-M c2 "*) echo RUNNING;; *) echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1;; esac',
    )
    in_job(monkeypatch, SLURM_CLUSTER_NAME="c1")
    d = tmp_path / "shards" / "00000"
    record = dict(host="n1", pid=5, slurm_job="88", since=1.0, nonce="abc")
    before = write_holder(d / "lock.excl", **record, slurm_cluster="c2")
    with pytest.raises(
        RunDirError, match=r"host n1 pid 5, Slurm job 88 on cluster c2 \(Slurm on cluster c2: RUNNING\)"
    ):
        with ShardLock(d, mode="file"):
            pass
    assert (d / "lock.excl").read_bytes() == before
    assert calls.read_text().splitlines() == ["-M c2 -h -j 88 -o %T"]
    write_holder(d / "lock.excl", **record, slurm_cluster="c1")  # our own cluster: asked as usual
    with ShardLock(d, mode="file"):
        assert json.loads((d / "lock.excl").read_text())["slurm_cluster"] == "c1"  # ours, recorded
    assert calls.read_text().splitlines()[1:] == ["-h -j 88 -o %T"]

    # Outside a job (a login node), the default cluster is what scontrol says.
    for var in SLURM_VARS:
        monkeypatch.delenv(var)
    fake_squeue(tmp_path, monkeypatch, 'echo "ClusterName             = c1"', name="scontrol")
    write_holder(d / "lock.excl", **record, slurm_cluster="c2")
    with pytest.raises(RunDirError, match=r"Slurm on cluster c2: RUNNING"):
        with ShardLock(d, mode="file"):
            pass
    write_holder(d / "lock.excl", **record, slurm_cluster="c1")
    with ShardLock(d, mode="file"):
        pass
    assert calls.read_text().splitlines()[2:] == ["-M c2 -h -j 88 -o %T", "-h -j 88 -o %T"]


def test_empty_lock_file_is_stale_only_when_old(tmp_path: Path) -> None:
    d = tmp_path / "shards" / "00000"
    d.mkdir(parents=True)
    (d / "lock.excl").write_bytes(b"")  # an older writer killed between create and write
    with pytest.raises(RunDirError, match=r"empty or unreadable, \d+ s old; it counts as stale after 300 s"):
        with ShardLock(d, mode="file"):
            pass
    old = os.stat(d / "lock.excl").st_mtime - lockfile_mod.LOCK_UNREADABLE_STALE_S - 5
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
    assert isinstance(e.value, TransientRunDirError)  # the shard loop asks again later
    assert (d / "lock.excl").read_bytes() == before
    assert sorted(p.name for p in d.iterdir()) == ["lock.excl"]


def test_squeue_hanging_is_refused_within_the_timeout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_squeue(tmp_path, monkeypatch, "exec sleep 60")
    monkeypatch.setattr(judge_mod, "SQUEUE_TIMEOUT_S", 1.0)
    d = tmp_path / "shards" / "00000"
    before = write_holder(d / "lock.excl", host="n1", pid=5, slurm_job="88", since=1.0, nonce="abc")
    with pytest.raises(RunDirError, match=r"Slurm did not answer \(squeue did not answer within 1 s\)"):
        with ShardLock(d, mode="file"):
            pass
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
        "from batchinfer import locks\n"
        "from batchinfer.locks import lockfile\n"
        "lockfile.os.link = lambda *a: os.kill(os.getpid(), signal.SIGKILL)\n"
        f"locks.ShardLock(Path({str(d)!r}), mode='file').__enter__()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert not (d / "lock.excl").exists()
    (leftover,) = d.glob("lock.excl.new-*")
    record = json.loads(leftover.read_text())  # a whole record, only never at the lock's name
    assert record["host"] == socket.gethostname() and record["nonce"]
    old = os.stat(leftover).st_mtime - lockfile_mod.LOCK_UNREADABLE_STALE_S - 5
    os.utime(leftover, (old, old))
    with ShardLock(d, mode="file"):
        assert not leftover.exists()  # killed contenders' leftovers go once old


# ---------------------------------------------------------------- one merge at a time


def _finished(tmp_path: Path, *extra: str) -> RunDir:
    run = prepared(tmp_path, 12, "sharding.num_shards=2", *extra)
    run_shards(run, [0, 1], engine=keyed(FakeEngine(), run))
    assert run.shard_folder(0).is_done() and run.shard_folder(1).is_done()
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

    def slow(r: RunDir, shard: Any, *rest: Any) -> Any:
        if shard.index == 1:  # shard 0 is in the first merge's temporary file by now
            inside.set()
            assert go.wait(30)
        return real(r, shard, *rest)

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
        "import sys, time\nfrom pathlib import Path\nfrom batchinfer.locks import RunLock\n"
        f"with RunLock(Path({str(run.path)!r}), mode='auto'):\n    print('held', flush=True)\n    sys.stdin.read()\n"
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
    with RunLock(run.path, mode=run.config.output.lock):
        pass


@pytest.mark.parametrize("mode", ["enosys", "enolck"])
def test_input_converts_where_flock_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    # datasets file-locks its conversion cache: in DIR that would fail before any shard runs.
    emulate(monkeypatch, mode, str(tmp_path / "run"))
    run = prepared(tmp_path, 7)
    assert run.shards()[0].rows == 7 and not (run.path / ".hf-cache").exists()
    assert [p.name for p in run.path.iterdir() if p.name.startswith(".flock-probe")] == []


def test_a_flock_holder_that_has_not_written_its_record_is_one_starting_now(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two runs racing for one folder: the loser reads the lock file before the winner wrote its
    record; it re-reads it a few times, then says who is there instead of 'host None pid None'."""
    lock = tmp_path / "lock"
    lock.touch()
    fd = os.open(lock, os.O_RDWR)  # the winner: flock granted, record not written yet
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    pauses: list[float] = []
    monkeypatch.setattr(lock_mod.time, "sleep", pauses.append)
    try:
        with pytest.raises(RunDirError) as got:
            with lock_mod.FileLock(lock, lambda who: f"output.dir X is in use by {who}", mode="flock"):
                pass
    finally:
        os.close(fd)
    assert str(got.value) == (
        "output.dir X is in use by another batchinfer starting now (its holder record is not written yet)"
    )
    assert pauses == list(lock_mod.RECORD_PAUSES)  # re-read after each pause, then given up


def test_a_flock_holder_whose_record_appears_while_we_wait_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lock = tmp_path / "lock"
    lock.touch()
    fd = os.open(lock, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    winner = Holder(host="node7", pid=4242)

    def winner_publishes(_: float) -> None:  # the winner writes its record during our first pause
        lock.write_text(json.dumps(winner.record()))

    monkeypatch.setattr(lock_mod.time, "sleep", winner_publishes)
    try:
        with pytest.raises(RunDirError) as got:
            with lock_mod.FileLock(lock, lambda who: f"in use by {who}", mode="flock"):
                pass
    finally:
        os.close(fd)
    assert str(got.value) == "in use by host node7 pid 4242"
