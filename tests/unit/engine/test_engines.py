"""Engines per task without an engine: device layouts, and the task handing shards to member
processes (stand-ins that speak the member protocol), counting a dead member's shard, requeueing once."""

from __future__ import annotations

import json
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from support.corpus import write_corpus
from support.runs import fake_model_dir

from batchinfer.config.compose import compose
from batchinfer.config.engines import engine_devices, engine_envs, engines_per_task, split_even, task_gpus
from batchinfer.config.schema import to_config
from batchinfer.engine.worker import Stopped
from batchinfer.errors import ConfigError, EngineFailure
from batchinfer.launch import engines, slurm
from batchinfer.launch.local import solo_engine, task_engines
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
    assert solo_engine(cfg("cluster.engines_per_task=4", tmp=tmp_path)) == {"index": 0, "of": 1, "devices": "0,1,2,3"}
    assert solo_engine(cfg(tmp=tmp_path)) is None


# A member stand-in: takes shards one at a time, "working" on each for its own time, writes a
# DONE-like marker; behaviour by index from BEHAVE (JSON): seconds per shard, die after N shards.
FAKE_MEMBER = r"""
import json, os, signal, sys, time
run_dir, index, of, fd_in, fd_out = sys.argv[1:]
behave = json.loads(os.environ["BEHAVE"])[int(index)]
stop = []
signal.signal(signal.SIGUSR2, lambda s, f: stop.append(s))
signal.signal(signal.SIGTERM, lambda s, f: stop.append(s))
inp, out = os.fdopen(int(fd_in)), os.fdopen(int(fd_out), "w", buffering=1)
taken = 0
while True:
    out.write("next\n")
    line = inp.readline().strip()
    if not line or line == "end":
        break
    taken += 1
    if behave.get("die_on") == taken:
        os.kill(os.getpid(), signal.SIGKILL)
    if behave.get("fail_on") == taken:  # its engine died: it counted the failure itself and says so
        out.write("exit " + json.dumps({"status": "failed", "shard": int(line), "failures": 1, "error": "EngineDeadError: gone"}) + "\n")
        sys.exit(1)
    if behave.get("wait_for_signal"):
        while not stop:
            time.sleep(0.05)
        out.write("exit " + json.dumps({"status": "stopped", "signal": stop[0]}) + "\n")
        sys.exit(3)
    time.sleep(behave.get("seconds", 0))
    deadline = time.monotonic() + 60
    while len([n for n in os.listdir(run_dir) if n.startswith("taken-")]) < behave.get("after_others", 0):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with open(os.path.join(run_dir, f"taken-{line}"), "w") as f:
        f.write(f"{index} {os.environ.get('VLLM_CPU_OMP_THREADS_BIND')} {os.environ.get('VLLM_PORT')}")
out.write("exit " + json.dumps({"status": "done"}) + "\n")
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


def taken(run: RunDir) -> dict[int, str]:
    return {int(p.name.split("-")[1]): p.read_text() for p in run.path.glob("taken-*")}


def test_shards_go_one_at_a_time_so_a_fast_engine_takes_more(
    tmp_path: Path, fake_members: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = small_run(tmp_path, 8)
    monkeypatch.setenv("VLLM_PORT", "29500")  # each engine scans for ports from a base of its own
    fake_members({"seconds": 0.0}, {"after_others": 7})  # engine 1 is slow: done when the rest are
    engines.run_engines(run, run.shards(), 2)
    got = taken(run)
    assert sorted(got) == list(range(8))  # every shard handed out exactly once
    by_engine = [k for k, v in got.items() if v == "0 0 29500"], [k for k, v in got.items() if v == "1 1 29600"]
    assert len(by_engine[0]) >= 7 and len(by_engine[1]) <= 1, got  # its own core each; the fast one takes more


def test_a_dead_engine_is_counted_under_its_shard_lock_and_its_sibling_finishes(
    tmp_path: Path, fake_members: Any, under_slurm: list[str]
) -> None:
    run = small_run(tmp_path, 6)
    fake_members({"seconds": 0.2}, {"die_on": 1})  # engine 1 dies on its first shard
    with pytest.raises(EngineFailure) as e:
        engines.run_engines(run, run.shards(), 2)
    got = taken(run)
    dead = ({s.index for s in run.shards()} - set(got)).pop()  # the shard engine 1 held
    assert sorted(got) == sorted(set(range(6)) - {dead}) and all(v.startswith("0 ") for v in got.values())
    msg = str(e.value)
    assert f"engine 1 of 2 (devices cpu:1) failed on shard {dead}" in msg and "killed by SIGKILL" in msg
    assert under_slurm == ["requeue"]  # once for the task
    progress = json.loads(run.progress_path(dead).read_text())
    assert progress["failures"] == 1 and progress["failures_by_job"] == {"77": 1}
    assert progress["engine"] == {"index": 1, "of": 2, "devices": "cpu:1"} and "SIGKILL" in progress["last_error"]


@pytest.fixture
def under_slurm(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """This process as Slurm task 77_0; the requeues it asks for are recorded, not sent."""
    requeues: list[str] = []
    monkeypatch.setattr(slurm, "this_job", lambda: "77_0")
    monkeypatch.setattr(slurm, "requeue_self", lambda: requeues.append("requeue") or True)
    monkeypatch.setattr(slurm, "requeue_this_job", lambda: requeues.append("requeue"))
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "77")
    return requeues


@pytest.mark.parametrize("signum, requeued", [(signal.SIGUSR2, ["requeue"]), (signal.SIGTERM, [])])
def test_a_stop_signal_reaches_every_engine_and_the_task_decides_once(
    tmp_path: Path, fake_members: Any, under_slurm: list[str], signum: int, requeued: list[str]
) -> None:
    run = small_run(tmp_path, 4)
    fake_members({"wait_for_signal": True}, {"wait_for_signal": True})
    before = signal.getsignal(signum)
    timer = threading.Timer(1.5, lambda: signal.raise_signal(signum))  # to the task only: it passes it on
    timer.start()
    with pytest.raises(Stopped) as e:
        engines.run_engines(run, run.shards(), 2)
    assert e.value.signum == signum
    assert under_slurm == requeued  # USR2: one requeue for the task, not one per engine; TERM: none
    assert signal.getsignal(signum) == before  # the task's handlers are undone


def test_engines_that_fail_requeue_the_task_once(tmp_path: Path, fake_members: Any, under_slurm: list[str]) -> None:
    run = small_run(tmp_path, 6)
    fake_members({"fail_on": 2}, {"fail_on": 1})
    with pytest.raises(EngineFailure) as e:
        engines.run_engines(run, run.shards(), 2)
    assert under_slurm == ["requeue"]
    assert "engine 0 of 2 (devices cpu:0) failed on shard" in str(e.value)
    assert "engine 1 of 2 (devices cpu:1) failed on shard" in str(e.value) and "EngineDeadError: gone" in str(e.value)
    assert len(taken(run)) == 1  # engine 0's first shard; no shard handed out twice, none after a failure


def test_a_task_with_fewer_shards_than_engines_starts_one_per_shard(tmp_path: Path) -> None:
    c = cfg("cluster.engines_per_task=4", tmp=tmp_path)
    assert task_engines(c, 2) == 2 and task_engines(c, 9) == 4
