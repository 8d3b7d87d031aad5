"""One engine running shards one after another in this process: the engine built on first use,
the stop signals' handlers, the progress bar, and a shard lock refused only because Slurm did not
answer tried again. What a stop or a failure means for the task is the caller's to decide: alone
(launch/local.py) or as one of a task's engines (launch/member.py)."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Optional

from batchinfer.config.schema import Config
from batchinfer.durable import refused_write, storage_error
from batchinfer.engine.compile_cache import CacheGate, cache_key, cache_site
from batchinfer.engine.dtype import settle
from batchinfer.engine.factory import engine_class
from batchinfer.engine.output import EngineOutput
from batchinfer.engine.shm import EngineSegments
from batchinfer.errors import BatchinferError, RunDirError, SlurmUnavailable, Stopped, TransientRunDirError
from batchinfer.inputs.shards import Shard
from batchinfer.locks.mode import configured_mode
from batchinfer.rundir.progress import EngineSlot, read_progress
from batchinfer.rundir.store import RunDir
from batchinfer.stopsignals import STOP_SIGNALS

log = logging.getLogger("batchinfer")
# A shard lock refused because Slurm did not answer about its holder is tried again after these
# waits (seconds); the last refusal is raised as any other.
LOCK_RETRY_WAITS = (10.0, 30.0, 60.0)


def progress_bar(total: int, initial: int, desc: str, file: Any = None, eta_after_commit: bool = False) -> Any:
    """tqdm on a terminal; plain lines about every 5 s in logs. With eta_after_commit, the bar is drawn
    once the engine is ready (its clock starts there), rows/s and the ETA from the first commit on
    (see RowBar)."""
    from batchinfer.engine.rowbar import RowBar

    file = file or sys.stderr
    tty = file.isatty()
    return RowBar(
        file=file,
        total=total,
        initial=initial,
        desc=desc,
        unit="row",
        mininterval=0.5 if tty else 5.0,
        ascii=not tty,
        dynamic_ncols=tty,
        eta_after_commit=eta_after_commit,
        plain=not tty,  # DESIGN: plain lines, no \r redraws, in Slurm logs and files
    )


class EngineHolder:
    """Builds the engine on first use (a finished run never imports vllm) and reuses it."""

    def __init__(self, c: Config, stop: Any, engine: Any = None, run_path: Optional[Path] = None, nodes: Any = None):
        self.c = c
        self.nodes = nodes  # a NodeGroup: this is node 0 of an engine over several nodes (launch/ranks.py)
        self.stop = stop
        self.engine = engine
        self.segments = EngineSegments()  # the engine's /dev/shm segments, removed when it stops
        self.cache: Optional[CacheGate] = None  # how the engine it built used vLLM's cache
        self.run_path = run_path
        # `model.dtype: auto` settled for the whole run in DIR/dtype.json (None: for this machine)
        self.dtype = settle(run_path, c.model.dtype) if run_path is not None else None
        if engine is not None:
            from batchinfer.engine.engine_args import model_key

            if engine.key != model_key(c):
                raise RunDirError("the engine passed in was built for another model config")
            if self.dtype not in (None, "auto", getattr(engine, "dtype", self.dtype)):
                raise RunDirError(f"the engine passed in runs {engine.dtype}; this run's shards use {self.dtype}")

    def __call__(self) -> Any:
        if self.engine is None:
            engine_cls = engine_class()  # vLLM's (a test may name a stand-in)

            # the folder name: the full path is in run.yaml (and printed once by prepare-model)
            log.info(
                "starting vLLM engine for %s",
                Path(self.c.model.path).name if os.path.isabs(self.c.model.path) else self.c.model.path,
            )

            def build() -> Any:
                # Block stop signals while the engine starts: its processes inherit the mask (a
                # group-wide USR2 cannot kill them) and a signal sent meanwhile stays pending.
                self.stop.block()
                try:
                    return engine_cls(self.c, self.dtype, **({"nodes": self.nodes} if self.nodes else {}))
                finally:
                    self.stop.install()

            # On vLLM's cache folder the first start of the model writes it and the others wait for
            # it (a stop signal while waiting stops); a start the cache fails is tried on a private
            # one. The cache lock's mechanism is the run's own (output.lock), as for its shard locks.
            mode = configured_mode(self.run_path) if self.run_path is not None else "auto"
            if self.cache is not None:
                self.cache.close()  # an earlier start that failed: its private cache
            self.cache = CacheGate(cache_site(self.c), cache_key(self.c, self.dtype), mode=mode)
            getattr(engine_cls, "prepare", lambda: None)()  # vLLM imported outside the cache's environment
            self.engine = self.cache.start(
                build, self.stop.check, getattr(engine_cls, "forget_failed_start", lambda: None)
            )
            log.info("engine ready in %.1f s", self.engine.startup_seconds)
            self.segments.record()
        return self.engine

    def close(self, owned: bool) -> None:
        """Stop the engine if this holder built it, and remove the shared memory its processes left."""
        if owned and self.engine is not None:
            self.segments.record()
            try:
                self.engine.close()
            finally:
                # vLLM's objects unlink the segments they made when collected: collected here, so
                # only what a stopped engine process left remains for the sweep
                self.engine = None
                gc.collect()
                self.segments.sweep()
        if self.cache is not None:
            self.cache.close()  # the private cache it started on (or tried to), if any


def rows_done(run: RunDir, index: int) -> int:
    """Rows of the shard committed so far, as its progress record says (0 before any)."""
    record = read_progress(run.shard_folder(index).progress_path)
    return record.rows_done if record is not None else 0


def transient_refusal(e: BaseException) -> bool:
    """Whether a shard lock refusal may go away by itself: Slurm did not answer about the holder."""
    return isinstance(e, (SlurmUnavailable, TransientRunDirError))


def run_shard_retrying(worker: Any, shard: Shard, stop: Any) -> None:
    """worker.run_shard, trying again while its lock is refused only because Slurm did not answer;
    a stop signal during a wait stops."""
    for wait in (*LOCK_RETRY_WAITS, None):
        try:
            worker.run_shard(shard)
            return
        except BatchinferError as e:
            if wait is None or not transient_refusal(e) or stop.signum is not None:
                raise
            log.warning("shard %d: %s; trying again in %g s", shard.index, e, wait)
        deadline = time.monotonic() + wait
        while stop.signum is None and time.monotonic() < deadline:
            time.sleep(min(0.5, wait))
        if stop.signum is not None:
            raise Stopped(stop.signum)


class ShardLoop:
    """Shards run one after another on one engine, with this process's stop handlers in place and
    a progress bar, from `with` to its end (the engine is stopped there if the loop built it).

    run() and start_engine() raise Stopped for a stop signal (also when the engine failed because
    the signal reached it too), StorageError when the run directory refuses a write, a
    BatchinferError as raised, and any other failure as raised with `current` (the shard it
    happened on, None before the first) and `failures` (that shard's failures in this submission,
    None if not counted) set."""

    def __init__(
        self,
        run: RunDir,
        engine: Any,
        output: EngineOutput,
        desc: str,
        slot: Optional[EngineSlot],
        total: int = 0,
        done: int = 0,
        ranks: Any = None,
    ):
        """ranks: the other nodes' engine ranks (launch/ranks.RankStep) of an engine over several nodes."""
        from batchinfer.engine.stopflag import StopFlag
        from batchinfer.engine.worker import ShardWorker

        self.rundir = run
        self.stop = StopFlag()
        self.saved = {s: signal.getsignal(s) for s in STOP_SIGNALS}
        self.holder = EngineHolder(run.config, self.stop, engine, run.path, ranks.group if ranks else None)
        self.owned = engine is None  # a loop that builds its engine stops it
        self.bar = progress_bar(total, done, desc=desc, file=output.bar_file(), eta_after_commit=True)
        self.worker = ShardWorker(run, self.holder, self.stop, self.bar)
        self.worker.engine_record = slot
        if ranks is not None:  # a rank's death is its node's fault, not the rows' in flight
            self.worker.node_fault = ranks.fault
        self.current: Optional[Shard] = None

    def __enter__(self) -> ShardLoop:
        self.stop.install()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar.close()
        self.holder.close(owned=self.owned)
        for s, h in self.saved.items():
            signal.signal(s, h)

    @property
    def failures(self) -> Optional[int]:
        """The current shard's failures in this submission, once the worker counted them."""
        return self.worker.failures

    def start_engine(self) -> None:
        """Start the engine now, before any shard is taken (no shard lock is held meanwhile); the
        engine record of the shards it runs says how long that took."""
        with self._judged():
            engine = self.holder()
        slot = self.worker.engine_record
        seconds = getattr(engine, "startup_seconds", None)
        if slot is not None and seconds is not None:
            self.worker.engine_record = {**slot, "startup_seconds": round(float(seconds), 2)}

    def count_in(self, shard: Shard) -> None:
        """Add a shard to the bar, for a loop that learns its shards one at a time."""
        self.bar.total += shard.rows
        self.bar.count_done(rows_done(self.rundir, shard.index))

    def run(self, shards: Iterable[Shard]) -> None:
        """Run each shard to its end on this loop's engine."""
        with self._judged():
            for self.current in shards:
                run_shard_retrying(self.worker, self.current, self.stop)

    @contextlib.contextmanager
    def _judged(self) -> Iterator[None]:
        """A failure that is a stop or a refused write raised as one (see the class)."""
        try:
            yield
        except (Stopped, BatchinferError):
            raise
        except Exception as e:
            if isinstance(e, OSError) and refused_write(e) is not None:
                raise storage_error(Path(e.filename or self.rundir.path), e) from None
            if self.stop.signum is not None:  # the signal reached the engine too: a stop, not a failure
                raise Stopped(self.stop.signum) from e
            raise
