"""Engines per task without an engine: device layouts, and the task handing shards to member
processes (stand-ins that speak the member protocol), counting a dead member's shard, requeueing once."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from support.corpus import write_corpus
from support.runs import fake_model_dir

from batchinfer.config.compose import compose
from batchinfer.config.engines import engine_devices, engine_envs, engines_per_task, split_even, task_gpus
from batchinfer.config.schema import to_config
from batchinfer.errors import ConfigError, EngineFailure
from batchinfer.launch import engines, slurm
from batchinfer.launch.local import solo_slot, task_engines
from batchinfer.rundir.prepare import prepare
from batchinfer.rundir.store import RunDir


def cfg(*overrides: str, tmp: Path) -> Any:
    return to_config(compose([f"input.path={tmp}/c.jsonl", f"model.path={fake_model_dir(tmp)}", *overrides]))


def test_auto_and_explicit_engines_for_a_node(tmp_path: Path) -> None:
    whole_node = cfg("cluster.gpus_per_task=8", "cluster.engines_per_task=auto", tmp=tmp_path)
    assert engines_per_task(whole_node) == 8
    tp2 = cfg("cluster.gpus_per_task=8", "cluster.engines_per_task=auto", "model.tensor_parallel_size=2", tmp=tmp_path)
    assert engines_per_task(tp2) == 4
    assert engines_per_task(cfg("cluster.engines_per_task=auto", tmp=tmp_path)) == 1  # no GPUs: one engine
    too_many = cfg(
        "cluster.gpus_per_task=8", "cluster.engines_per_task=5", "model.tensor_parallel_size=2", tmp=tmp_path
    )
    with pytest.raises(ConfigError) as e:
        engines_per_task(too_many)
    for name in ("cluster.engines_per_task=5", "tensor_parallel_size", "cluster.gpus_per_task=8"):
        assert name in str(e.value)
    with pytest.raises(ConfigError, match="engines_per_task=0 is out of range"):
        cfg("cluster.engines_per_task=0", tmp=tmp_path)
    with pytest.raises(ConfigError, match="'two' is out of range"):
        cfg("cluster.engines_per_task=two", tmp=tmp_path)


def test_each_engine_gets_its_own_gpus_or_cores(tmp_path: Path) -> None:
    tp2 = cfg("cluster.gpus_per_task=8", "cluster.engines_per_task=auto", "model.tensor_parallel_size=2", tmp=tmp_path)
    gpus = task_gpus(tp2, {"CUDA_VISIBLE_DEVICES": "4,5,6,7,0,1,2,3"})  # Slurm's ids, in its order
    assert engine_envs(tp2, 4, gpus, []) == [
        {"CUDA_VISIBLE_DEVICES": "4,5"},
        {"CUDA_VISIBLE_DEVICES": "6,7"},
        {"CUDA_VISIBLE_DEVICES": "0,1"},
        {"CUDA_VISIBLE_DEVICES": "2,3"},
    ]
    assert task_gpus(tp2, {}) == [str(i) for i in range(8)]  # no CUDA_VISIBLE_DEVICES: the first 8
    assert task_gpus(tp2, {"CUDA_VISIBLE_DEVICES": ""}) == []
    with pytest.raises(ConfigError, match="set cluster.gpus_per_task=10"):
        engine_envs(tp2, 5, gpus, [])
    cpu = cfg("cluster.engines_per_task=2", tmp=tmp_path)
    assert engine_envs(cpu, 2, [], [0, 1, 2, 3, 8]) == [
        {"VLLM_CPU_OMP_THREADS_BIND": "0-2"},
        {"VLLM_CPU_OMP_THREADS_BIND": "3,8"},
    ]
    with pytest.raises(ConfigError, match="needs at least 3 cores; this task has 2"):
        engine_envs(cpu, 3, [], [0, 1])
    assert split_even(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    # What DONE.json's engine record says each one runs on, from the same environments.
    assert [engine_devices(e) for e in engine_envs(cpu, 2, [], [0, 1, 2, 3, 8])] == ["cpu:0-2", "cpu:3,8"]
    assert engine_devices({"CUDA_VISIBLE_DEVICES": "6,7"}) == "6,7"
    assert engine_devices({"VLLM_CPU_OMP_THREADS_BIND": "auto"}) == engine_devices({}) == "cpu"


def test_a_lone_engine_records_that_it_holds_the_whole_task(tmp_path: Path, monkeypatch) -> None:
    """Fewer shards left than engines_per_task: the one engine says `of 1`, so report charges it
    every GPU of the task; with engines_per_task=1 shards carry no engine record, as before."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert solo_slot(cfg("cluster.engines_per_task=4", tmp=tmp_path)) == {"index": 0, "of": 1, "devices": "0,1,2,3"}
    assert solo_slot(cfg(tmp=tmp_path)) is None


# A member stand-in speaking launch/protocol.py: takes shards one at a time, "working" on each for
# its own time, appends a line per shard it is handed to hand-outs.log (a shard handed out twice
# shows twice); behaviour by index from BEHAVE (JSON). It records the signals blocked when it
# started (the task must start it with USR2 blocked) and keeps USR2 blocked until it asks for its
# first shard, as a real member does until its handlers are in place.
FAKE_MEMBER = r"""
import json, os, signal, sys, time
run_dir, index, of, fd_in, fd_out = sys.argv[1:]
behave = json.loads(os.environ["BEHAVE"])[int(index)]
blocked = [s.name for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])]
with open(os.path.join(run_dir, f"blocked-{index}"), "w") as f:
    f.write(" ".join(sorted(blocked)))
stop = []
signal.signal(signal.SIGUSR2, lambda s, f: stop.append(s))
signal.signal(signal.SIGTERM, lambda s, f: stop.append(s))
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR2})
inp, out = os.fdopen(int(fd_in), "rb", buffering=0), int(fd_out)
def say(text):
    os.write(out, text.encode())
def exit_record(**rec):
    say("exit " + json.dumps(rec) + "\n")
if behave.get("fork"):  # as vLLM's engine core: a forked process that keeps the pipe, in the group
    child = os.fork()
    if child == 0:
        time.sleep(600)
        os._exit(0)
    with open(os.path.join(run_dir, f"child-{index}"), "w") as f:
        f.write(str(child))
taken = 0
while True:
    say("next\n")
    if behave.get("die_after_asking"):
        os.kill(os.getpid(), signal.SIGKILL)  # dead before reading the answer: the task's write breaks
    line = b""
    while not line.endswith(b"\n"):
        chunk = inp.read(1)
        if not chunk:
            break
        line += chunk
    line = line.decode().strip()
    if not line or line == "end":
        break
    if behave.get("die_before_took"):
        os.kill(os.getpid(), signal.SIGKILL)  # answered, never started
    say(f"took {line}\n")
    taken += 1
    with open(os.path.join(run_dir, "hand-outs.log"), "a") as f:
        f.write(f"{line} {index} {os.environ.get('VLLM_CPU_OMP_THREADS_BIND')} {os.environ.get('VLLM_PORT')}\n")
    if behave.get("die_on") == taken:
        os.kill(os.getpid(), signal.SIGKILL)
    if behave.get("fail_on") == taken:  # its engine died: it counted the failure itself and says so
        exit_record(status="failed", shard=int(line), failures=1, error="EngineDeadError: gone")
        sys.exit(1)
    if behave.get("wait_for_signal"):
        while not stop:
            time.sleep(0.05)
        if behave.get("then") == "config_error":
            exit_record(status="error", kind="ConfigError", error="model.path: no such folder")
            sys.exit(2)
        if behave.get("then") == "half_exit":
            say('exit {"status": "stop')  # killed while writing its last words
            os.kill(os.getpid(), signal.SIGKILL)
        exit_record(status="stopped", signal=stop[0])
        sys.exit(3)
    time.sleep(behave.get("seconds", 0))
    deadline = time.monotonic() + 60
    while len(open(os.path.join(run_dir, "hand-outs.log")).read().splitlines()) < behave.get("after_others", 0):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with open(os.path.join(run_dir, f"finished-{line}"), "w") as f:
        f.write(index)
    say(f"done {line}\n")
    if behave.get("die_after_done") == taken:
        os.kill(os.getpid(), signal.SIGKILL)  # finished its shard, dead before asking again
if behave.get("hang_at_exit"):
    exit_record(status="done")
    os.close(out)
    time.sleep(600)  # closed its pipe, never exits
exit_record(status="done")
"""


@pytest.fixture
def fake_members(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    script = tmp_path / "member.py"
    script.write_text(FAKE_MEMBER)
    monkeypatch.setattr(engines, "MEMBER", [sys.executable, str(script)])
    monkeypatch.setattr(engines.os, "sched_getaffinity", lambda pid: {0, 1})

    def behave(*members: dict[str, Any]) -> None:
        monkeypatch.setenv("BEHAVE", json.dumps(list(members)))

    return behave


def small_run(tmp_path: Path, shards: int) -> RunDir:
    write_corpus(tmp_path / "c.jsonl", shards * 3)
    overrides = [f"input.path={tmp_path}/c.jsonl", f"model.path={fake_model_dir(tmp_path)}"]
    run = prepare(compose([*overrides, f"output.dir={tmp_path}/run", f"sharding.num_shards={shards}"]))
    return run


def hand_outs(run: RunDir) -> list[tuple[int, str]]:
    """(shard, `engine cores port`) per hand-out a member acknowledged, in order."""
    log = run.path / "hand-outs.log"
    lines = log.read_text().splitlines() if log.exists() else []
    return [(int(ln.split(" ", 1)[0]), ln.split(" ", 1)[1]) for ln in lines]


def finished(run: RunDir) -> dict[int, str]:
    """{shard: the engine that finished it}."""
    return {int(p.name.split("-")[1]): p.read_text() for p in run.path.glob("finished-*")}


def failures_counted(run: RunDir) -> dict[int, int]:
    """{shard: failures in its progress.json}, for shards that have one."""
    out = {}
    for s in run.shards():
        if run.shard_folder(s.index).progress_path.is_file():
            out[s.index] = json.loads(run.shard_folder(s.index).progress_path.read_text()).get("failures", 0)
    return {k: v for k, v in out.items() if v}


def test_shards_go_one_at_a_time_so_a_fast_engine_takes_more(
    tmp_path: Path, fake_members: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = small_run(tmp_path, 8)
    monkeypatch.setenv("VLLM_PORT", "29500")  # each engine scans for ports from a base of its own
    fake_members({"seconds": 0.0}, {"after_others": 8})  # engine 1 is slow: done when the rest are handed out
    engines.run_engines(run, run.shards(), 2)
    got = hand_outs(run)
    assert sorted(s for s, _ in got) == list(range(8))  # every shard handed out exactly once
    assert sorted(finished(run)) == list(range(8))
    by_engine = [s for s, v in got if v == "0 0 29500"], [s for s, v in got if v == "1 1 29600"]
    assert len(by_engine[0]) >= 7 and len(by_engine[1]) <= 1, got  # its own core each; the fast one takes more


def test_a_dead_engine_is_counted_under_its_shard_lock_and_its_sibling_finishes(
    tmp_path: Path, fake_members: Any, under_slurm: list[str]
) -> None:
    run = small_run(tmp_path, 6)
    fake_members({"seconds": 0.2}, {"die_on": 1})  # engine 1 dies on its first shard
    with pytest.raises(EngineFailure) as e:
        engines.run_engines(run, run.shards(), 2)
    got = hand_outs(run)
    (dead,) = [s for s, v in got if v.startswith("1 ")]  # the shard engine 1 held
    assert sorted(s for s, _ in got) == list(range(6))  # each handed out once
    assert sorted(finished(run)) == sorted(set(range(6)) - {dead}) and set(finished(run).values()) == {"0"}
    msg = str(e.value)
    assert f"engine 1 of 2 (devices cpu:1) failed on shard {dead}" in msg and "killed by SIGKILL" in msg
    assert under_slurm == ["requeue"]  # once for the task
    progress = json.loads(run.shard_folder(dead).progress_path.read_text())
    assert progress["failures"] == 1 and progress["failures_by_job"] == {"77": 1}
    assert progress["engine"] == {"index": 1, "of": 2, "devices": "cpu:1"} and "SIGKILL" in progress["last_error"]
    assert failures_counted(run) == {dead: 1}


@pytest.mark.parametrize("when", ["die_after_asking", "die_before_took"])
def test_a_member_dead_before_taking_its_shard_is_charged_nothing_and_the_shard_is_done(
    tmp_path: Path, fake_members: Any, under_slurm: list[str], when: str
) -> None:
    """Dead after `next` (the answer to a closed pipe) or after the answer, before `took`: the
    task makes its decision all the same, the shard goes to the sibling, no failure is counted."""
    run = small_run(tmp_path, 4)
    fake_members({"seconds": 0.3}, {when: True})
    with pytest.raises(EngineFailure) as e:
        engines.run_engines(run, run.shards(), 2)
    assert "engine 1 of 2 (devices cpu:1) failed: the engine's worker process died (killed by SIGKILL)" in str(e.value)
    assert sorted(s for s, _ in hand_outs(run)) == [0, 1, 2, 3]  # each shard taken once, all by engine 0
    assert finished(run) == {0: "0", 1: "0", 2: "0", 3: "0"}
    assert failures_counted(run) == {}
    assert under_slurm == []  # no shard failed: nothing to retry


def test_a_member_dead_after_finishing_its_shard_does_not_charge_it(
    tmp_path: Path, fake_members: Any, under_slurm: list[str]
) -> None:
    run = small_run(tmp_path, 4)
    fake_members({"seconds": 0.3}, {"die_after_done": 1})
    with pytest.raises(EngineFailure) as e:
        engines.run_engines(run, run.shards(), 2)
    (mine,) = [s for s, v in hand_outs(run) if v.startswith("1 ")]
    assert finished(run)[mine] == "1" and sorted(finished(run)) == [0, 1, 2, 3]
    assert "on shard" not in str(e.value) and "killed by SIGKILL" in str(e.value)
    assert failures_counted(run) == {}


@pytest.mark.timeout(60)  # a task waiting for the end of file would wait as long as the child lives
def test_a_member_killed_alone_while_its_fork_holds_the_pipe_does_not_hang_the_task(
    tmp_path: Path, fake_members: Any, under_slurm: list[str]
) -> None:
    """As vLLM's engine core does, the member's forked child keeps the pipe open: the task sees
    no end of file, so it must notice the member's exit, and kill the child with the group."""
    run = small_run(tmp_path, 4)
    fake_members({"seconds": 0.3}, {"fork": True, "die_on": 1})
    with pytest.raises(EngineFailure) as e:
        engines.run_engines(run, run.shards(), 2)
    (dead,) = [s for s, v in hand_outs(run) if v.startswith("1 ")]
    assert f"engine 1 of 2 (devices cpu:1) failed on shard {dead}" in str(e.value) and "SIGKILL" in str(e.value)
    assert failures_counted(run) == {dead: 1}
    child = int((run.path / "child-1").read_text())
    assert not alive(child)  # killed with the member's process group


def alive(pid: int) -> bool:
    """Whether pid is a live process (a zombie is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timeout(60)
def test_a_member_that_closes_its_pipe_and_hangs_is_killed(
    tmp_path: Path, fake_members: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = small_run(tmp_path, 2)
    monkeypatch.setattr(engines, "REAP_WAIT_S", 0.5)
    said: list[str] = []
    monkeypatch.setattr(engines.log, "warning", lambda msg, *args: said.append(msg % args))
    fake_members({}, {"hang_at_exit": True})
    engines.run_engines(run, run.shards(), 2)  # both said done: the hung one is killed, not waited for
    assert sorted(finished(run)) == [0, 1]
    assert "engine 1 closed its pipe but did not exit within 0.5 s: killing it" in said, said


@pytest.fixture
def under_slurm(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """This process as Slurm task 77_0; the requeues it asks for are recorded, not sent."""
    requeues: list[str] = []
    monkeypatch.setattr(slurm, "this_job", lambda: "77_0")
    monkeypatch.setattr(slurm, "requeue_task", lambda: requeues.append("requeue"))
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "77")
    return requeues


# The task in a process of its own, as `batchinfer worker` runs it: USR2 blocked before anything
# else (cli.main, slurm_task), so in every thread; a signal sent to the process (not its group, as
# plain sbatch's B:USR2) reaches it only if it unblocks USR2 itself. Prints how it ended.
TASK = r"""
import json, signal, sys
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
from batchinfer.errors import Stopped
from batchinfer.launch import engines, slurm
from batchinfer.rundir.store import RunDir
requeues = []
slurm.this_job = lambda: "77_0"
slurm.requeue_task = lambda: requeues.append("requeue")
engines.MEMBER = [sys.executable, sys.argv[2]]
engines.os.sched_getaffinity = lambda pid: {0, 1}
run = RunDir(sys.argv[1])
try:
    engines.run_engines(run, run.shards(), 2)
    ended = "finished"
except Stopped as e:
    ended = f"stopped {e.signum}"
except Exception as e:
    ended = f"{type(e).__name__}: {e}"
print("ENDED " + json.dumps({"ended": ended, "requeues": requeues}))
"""


def run_task_signalled(run: RunDir, tmp_path: Path, signum: int) -> dict[str, Any]:
    """Run the task in a process of its own; once both members have taken a shard, send signum to
    the task's process alone. Returns how it ended and the requeues it asked for."""
    import subprocess

    proc = subprocess.Popen(
        [sys.executable, "-c", TASK, str(run.path), str(tmp_path / "member.py")],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
    )
    try:
        deadline = time.monotonic() + 50
        while len(hand_outs(run)) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        os.kill(proc.pid, signum)
        out, _ = proc.communicate(timeout=50)
    finally:
        if proc.poll() is None:  # it never acted on the signal: TERM stops it and its members
            proc.terminate()
            proc.communicate(timeout=30)
    (line,) = [ln for ln in out.splitlines() if ln.startswith("ENDED ")]
    return json.loads(line[6:])


@pytest.mark.timeout(120)  # a USR2 the task never unblocks would leave it waiting for ever
@pytest.mark.parametrize("signum, requeued", [(signal.SIGUSR2, ["requeue"]), (signal.SIGTERM, [])])
def test_a_stop_signal_reaches_every_engine_and_the_task_decides_once(
    tmp_path: Path, fake_members: Any, signum: int, requeued: list[str]
) -> None:
    run = small_run(tmp_path, 4)
    fake_members({"wait_for_signal": True}, {"wait_for_signal": True})
    got = run_task_signalled(run, tmp_path, signum)  # to the task only (plain sbatch's B:USR2): it passes it on
    assert got == {"ended": f"stopped {signum}", "requeues": requeued}  # one requeue for the task, not per engine
    for k in (0, 1):  # members start with USR2 blocked: a group-wide USR2 cannot kill them early
        assert "SIGUSR2" in (run.path / f"blocked-{k}").read_text().split()


def test_the_task_undoes_its_handlers_and_mask(tmp_path: Path, fake_members: Any) -> None:
    run = small_run(tmp_path, 2)
    fake_members({}, {})
    before = {s: signal.getsignal(s) for s in engines.STOP_SIGNALS}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    engines.run_engines(run, run.shards(), 2)
    assert {s: signal.getsignal(s) for s in engines.STOP_SIGNALS} == before
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == mask
    assert sorted(finished(run)) == [0, 1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("then", ["config_error", "half_exit"])
def test_a_requested_requeue_wins_over_what_a_member_does_after_the_signal(
    tmp_path: Path, fake_members: Any, then: str
) -> None:
    """After USR2, one member reports a config error (or is killed half way through its exit
    record): the task still stops and requeues once, as the signal asked."""
    run = small_run(tmp_path, 4)
    fake_members({"wait_for_signal": True}, {"wait_for_signal": True, "then": then})
    got = run_task_signalled(run, tmp_path, signal.SIGUSR2)
    assert got == {"ended": f"stopped {int(signal.SIGUSR2)}", "requeues": ["requeue"]}


def test_engines_that_fail_requeue_the_task_once(tmp_path: Path, fake_members: Any, under_slurm: list[str]) -> None:
    run = small_run(tmp_path, 6)
    fake_members({"fail_on": 2}, {"fail_on": 1})
    with pytest.raises(EngineFailure) as e:
        engines.run_engines(run, run.shards(), 2)
    assert under_slurm == ["requeue"]
    assert "engine 0 of 2 (devices cpu:0) failed on shard" in str(e.value)
    assert "engine 1 of 2 (devices cpu:1) failed on shard" in str(e.value) and "EngineDeadError: gone" in str(e.value)
    assert len(finished(run)) == 1  # engine 0's first shard
    got = [s for s, _ in hand_outs(run)]
    assert len(got) == 3 and len(set(got)) == 3  # no shard handed out twice, none after a failure


def test_a_task_with_fewer_shards_than_engines_starts_one_per_shard(tmp_path: Path) -> None:
    c = cfg("cluster.engines_per_task=4", tmp=tmp_path)
    assert task_engines(c, 2) == 2 and task_engines(c, 9) == 4


def test_a_lock_refused_because_slurm_did_not_answer_is_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transient refusal (the holder's job could not be checked) is retried, not an error of the
    run; any other refusal is raised at once."""
    from support.fake_engine import FakeEngine, keyed

    from batchinfer.engine import worker
    from batchinfer.errors import RunDirError, TransientRunDirError
    from batchinfer.launch import local, shardloop

    run = small_run(tmp_path, 1)
    refusals = ["the holder's job could not be checked just now"] * 2

    class FlakyLock(worker.ShardLock):  # type: ignore[misc,valid-type]
        def __enter__(self) -> Any:
            if refusals:
                error = TransientRunDirError if "just now" in refusals[-1] else RunDirError
                raise error(f"shard 0 is being processed by job 12_3; {refusals.pop()}: try again later")
            return super().__enter__()

    monkeypatch.setattr(worker, "ShardLock", FlakyLock)
    monkeypatch.setattr(shardloop, "LOCK_RETRY_WAITS", (0.0, 0.0, 0.0))
    local.run_shards(run, [0], engine=keyed(FakeEngine(), run))
    assert run.shard_folder(0).is_done() and not refusals
    refusals[:] = ["it is held by pid 4242 on this host"]  # alive: not transient
    (tmp_path / "again").mkdir()
    run2 = small_run(tmp_path / "again", 1)
    with pytest.raises(RunDirError, match="pid 4242"):
        local.run_shards(run2, [0], engine=keyed(FakeEngine(), run2))
    assert refusals == []
