"""CPU seconds of the worker's phases (read, render, tokenize, ...), for the ceiling benchmark
(benchmarks/ceiling.py). Off unless turned on: a phase is timed per window or per commit, never per
row, and off it costs one attribute test."""

from __future__ import annotations

import threading
import time
from typing import Any, Optional

# The phases, in the order a row meets them (the benchmark's table follows it).
PHASES = (
    "read",  # input rows as Python dicts, a slice at a time
    "request",  # a row's request apart from its tokens: template fill, sampling, the overlong policy, keys
    "render",  # chat templates rendered to text
    "tokenize",  # texts to token ids (the tokenizer's batch call)
    "digest",  # request digests (output.reuse, the request_digest column)
    "dedup",  # identical requests joined, finished results taken from the cache
    "order",  # a window put in work order
    "submit",  # requests handed to the engine (the engine's own time inside included)
    "collect",  # finished requests made output rows
    "commit",  # parts written, progress.json
    "compaction",  # a finished shard's parts compacted, DONE.json
    "merge",  # the run's output written
)


class _Timer:
    """One phase being timed on one thread; a phase timed inside it is its own, not this one's."""

    __slots__ = ("clock", "name", "cpu", "wall", "inner_cpu", "inner_wall", "outer")

    def __init__(self, clock: PhaseClock, name: str):
        self.clock, self.name = clock, name
        self.cpu = self.wall = self.inner_cpu = self.inner_wall = 0.0
        self.outer: Optional[_Timer] = None

    def __enter__(self) -> _Timer:
        stack = self.clock.stack()
        self.outer = stack[-1] if stack else None
        stack.append(self)
        self.cpu, self.wall = time.thread_time(), time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        cpu, wall = time.thread_time() - self.cpu, time.perf_counter() - self.wall
        self.clock.stack().pop()
        if self.outer is not None:
            self.outer.inner_cpu += cpu
            self.outer.inner_wall += wall
        self.clock.add(self.name, cpu - self.inner_cpu, wall - self.inner_wall)


class _Off:
    """The timer when the clock is off: nothing."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


_OFF = _Off()


class PhaseClock:
    """Per phase: CPU seconds of the thread that ran it (a phase on a helper thread is counted once),
    wall seconds, and how many times it ran."""

    def __init__(self) -> None:
        self.on = False
        self._lock = threading.Lock()
        self._local = threading.local()  # each thread's phases being timed, innermost last
        self.cpu: dict[str, float] = {}
        self.wall: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def enable(self) -> None:
        """Start timing (from zero)."""
        with self._lock:
            self.cpu, self.wall, self.calls = {}, {}, {}
        self.on = True

    def disable(self) -> None:
        """Stop timing; the figures stay."""
        self.on = False

    def stack(self) -> list[_Timer]:
        """This thread's phases being timed."""
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def __call__(self, name: str) -> Any:
        """A context manager timing one run of a phase (nothing while the clock is off)."""
        return _Timer(self, name) if self.on else _OFF

    def add(self, name: str, cpu: float, wall: float) -> None:
        """Count one run of a phase."""
        with self._lock:
            self.cpu[name] = self.cpu.get(name, 0.0) + cpu
            self.wall[name] = self.wall.get(name, 0.0) + wall
            self.calls[name] = self.calls.get(name, 0) + 1

    def figures(self, names: Optional[tuple[str, ...]] = None) -> dict[str, dict[str, float]]:
        """{phase: {cpu_s, wall_s, calls}} of the phases timed so far."""
        with self._lock:
            return {
                n: {"cpu_s": self.cpu[n], "wall_s": self.wall[n], "calls": self.calls[n]}
                for n in (names or tuple(self.cpu))
                if n in self.cpu
            }


CLOCK = PhaseClock()  # the process's clock: the benchmark turns it on
