"""Named fault points: BATCHINFER_FAULT=name[:n] SIGKILLs the process at the nth hit (tests)."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

from batchinfer import slurm_env

ENV = "BATCHINFER_FAULT"
# Benchmarks: append "<time> <rows finished so far>" to this file at every engine step.
TRACE_ENV = "BATCHINFER_TRACE"
# A prompt containing this text kills the engine's processes when it is fed (a "poison row").
POISON_ENV = "BATCHINFER_POISON"
# Slurm tests: after its first committed part a worker waits up to this many seconds for a stop
# signal, so a signal, requeue or engine kill surely lands on a partial shard of a small corpus.
HOLD_ENV = "BATCHINFER_HOLD"
# Tests: append one JSON line per engine start to this file (pid, Slurm job, seconds), so a test
# run can say how many engines it started in-process, in subprocesses and in Slurm tasks.
ENGINE_LOG_ENV = "BATCHINFER_ENGINE_LOG"
# Tests and benchmarks: append one JSON line per gated engine start to this file: how it used vLLM's
# cache (wrote it, read it, a private one and why) and how long it waited for the cache lock.
CACHE_LOG_ENV = "BATCHINFER_CACHE_LOG"
# Tests: "module:Class" of a stand-in engine that workers build instead of vLLM's (tests/support/standin.py),
# for Slurm-mechanics and launcher tests in other processes that need the worker, not vLLM.
STANDIN_ENV = "BATCHINFER_STANDIN_ENGINE"
# Tests: a worker of an engine rank on a node after the first raises at its nth step (vLLM's
# ValueError, as a step the rank cannot run does).
RANK_RAISE_ENV = "BATCHINFER_RANK_RAISE"
NODE_RANK_ENV = "BATCHINFER_NODE_RANK"  # set by an engine rank's process for its workers
# The fault points: call sites name them by these constants, so grep finds each point's places.
IN_PART_WRITE = "in-part-write"  # half of a part's bytes are in its temporary file
BEFORE_PART_RENAME = "before-part-rename"  # temporary part complete and fsynced, not yet renamed
AFTER_PART_RENAME = "after-part-rename"  # part visible, progress.json not yet updated
AFTER_PROGRESS = "after-progress"  # part and progress.json committed
IN_GENERATE = "in-generate"  # between engine steps
BEFORE_DONE = "before-done"  # last part committed, DONE.json not yet written
IN_COMPACT_WRITE = "in-compact-write"  # half of a finished shard's compacted file is in its temporary file
BEFORE_COMPACT_RENAME = "before-compact-rename"  # compacted temporary complete and fsynced, not yet published
AFTER_COMPACT_RENAME = "after-compact-rename"  # compacted file published, DONE.json not yet written (a leftover)
AFTER_COMPACT_DONE = "after-compact-done"  # DONE.json names the compacted file, the parts not yet removed
IN_COMPACT_CLEANUP = "in-compact-cleanup"  # the first part removed, the others not yet
IN_MERGE = "in-merge"  # merged output half written
BEFORE_MERGE_RENAME = "before-merge-rename"  # merged output complete and fsynced, not yet renamed into place
IN_MERGE_SWAP = "in-merge-swap"  # a folder output (split files, hf) moved aside, the new one not yet in place
PASS_FOLDER_MADE = "pass-folder-made"  # a redo's DIR/passes/N made, its pass.json not yet written
POINTS = (
    IN_PART_WRITE,
    BEFORE_PART_RENAME,
    AFTER_PART_RENAME,
    AFTER_PROGRESS,
    IN_GENERATE,
    BEFORE_DONE,
    IN_COMPACT_WRITE,
    BEFORE_COMPACT_RENAME,
    AFTER_COMPACT_RENAME,
    AFTER_COMPACT_DONE,
    IN_COMPACT_CLEANUP,
    IN_MERGE,
    BEFORE_MERGE_RENAME,
    IN_MERGE_SWAP,
    PASS_FOLDER_MADE,
)


class WritePoints(NamedTuple):
    """The fault points of one durable write: half written, complete before its rename, after it."""

    in_write: str
    before_rename: str
    after_rename: str


PART_WRITE = WritePoints(IN_PART_WRITE, BEFORE_PART_RENAME, AFTER_PART_RENAME)
COMPACT_WRITE = WritePoints(IN_COMPACT_WRITE, BEFORE_COMPACT_RENAME, AFTER_COMPACT_RENAME)
_hits: Counter[str] = Counter()
_held = False


def point(name: str) -> None:
    """Kill this process (and its group, when it leads one) if BATCHINFER_FAULT names this hit."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    want, _, nth = spec.partition(":")
    if want != name:
        return
    _hits[name] += 1
    if _hits[name] != int(nth or 1):
        return
    # Kill the engine processes with us, as a node failure or OOM killer would.
    if os.getpgid(0) == os.getpid():
        os.killpg(0, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def hold(stopped: Callable[[], bool]) -> None:
    """Wait (once per process) while BATCHINFER_HOLD asks and stopped() is false (a stop signal, a
    dead engine); a requeued Slurm job's later runs (SLURM_RESTART_COUNT > 0) do not wait, so they
    finish the shard."""
    global _held
    seconds = float(os.environ.get(HOLD_ENV) or 0)
    if _held or seconds <= 0 or slurm_env.current().restart_count > 0:
        return
    _held = True
    deadline = time.monotonic() + seconds
    while not stopped() and time.monotonic() < deadline:
        time.sleep(0.1)


def poisoned(prompt: object) -> bool:
    """Whether BATCHINFER_POISON marks this prompt as one that kills the engine."""
    marker = os.environ.get(POISON_ENV)
    return bool(marker) and marker in str(prompt)


def kill_engine() -> None:
    """SIGKILL this process's children (the vLLM engine core), as a CUDA fault or OOM would."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass


def rank_step() -> None:
    """Raise ValueError at the step BATCHINFER_RANK_RAISE names, in a worker of a node after the first."""
    want = os.environ.get(RANK_RAISE_ENV)
    if not want or int(os.environ.get(NODE_RANK_ENV, "0")) == 0:
        return
    _hits[RANK_RAISE_ENV] += 1
    if _hits[RANK_RAISE_ENV] == int(want):
        raise ValueError(f"{RANK_RAISE_ENV}={want}: this rank's step raises")


def trace_finished(rows: int) -> None:
    """Record how many rows this process has finished (for measuring work lost to a kill)."""
    path = os.environ.get(TRACE_ENV)
    if path:
        with open(path, "a") as f:
            f.write(f"{time.time():.3f} {rows}\n")


def record_engine_start(seconds: float, model: object) -> None:
    """Append this engine start to BATCHINFER_ENGINE_LOG, when it is set."""
    path = os.environ.get(ENGINE_LOG_ENV)
    if not path:
        return
    import json

    rec = {
        "pid": os.getpid(),
        "slurm_job": slurm_env.current().job_id,
        "seconds": round(seconds, 2),
        "model": str(model),
    }
    with open(path, "a") as f:  # one short O_APPEND write per line: concurrent starts do not interleave
        f.write(json.dumps(rec) + "\n")


def record_cache_start(record: dict[str, object]) -> None:
    """Append how an engine start used vLLM's cache (engine/compile_cache.py) to BATCHINFER_CACHE_LOG."""
    path = os.environ.get(CACHE_LOG_ENV)
    if not path:
        return
    from batchinfer.redaction import record_json  # a reason quotes an engine error

    rec = {"pid": os.getpid(), "slurm_job": slurm_env.current().job, "at": round(time.time(), 3), **record}
    with open(path, "a") as f:  # one short O_APPEND write per line: concurrent starts do not interleave
        f.write(record_json(rec) + "\n")
