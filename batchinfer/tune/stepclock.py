"""A trial's engine with its steps timed: each step's seconds, the requests in the order they were
sent and what each finished with (prompt tokens, prefix-cache hits, output tokens). After a rung,
its requests are replayed (tune/batching.py) and the measured steps paired with the replay's, what
the cost of a step is fitted on (tune/costmodel.py)."""

from __future__ import annotations

import time
from typing import Any, Optional

from batchinfer.tune.batching import Limits, Work, steps
from batchinfer.tune.costmodel import StepStats, measure_steps


class StepClock:
    """Wraps the engine the worker is given; everything but add, step and abort_all passes through."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.reset()

    def reset(self) -> None:
        """Forget the last rung's steps and requests."""
        self.durations: list[float] = []
        self.sent: list[str] = []
        self.finished: dict[str, tuple[int, int, int]] = {}  # request id -> (prompt, cached, output)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def add(self, request_id: str, token_ids: list[int], params: Any, **kw: Any) -> None:
        """Send a request (one the engine refuses is not counted); kw (adapter=) as the engine takes it."""
        self.engine.add(request_id, token_ids, params, **kw)
        self.sent.append(request_id)

    def step(self) -> list[Any]:
        """One engine step, timed."""
        t0 = time.monotonic()
        done = self.engine.step()
        self.durations.append(time.monotonic() - t0)
        for c in done:
            self.finished[c.request_id] = (c.prompt_tokens, c.cached_tokens or 0, c.output_tokens)
        return done

    def abort_all(self) -> None:
        """Abort what is in flight (its requests finish nothing)."""
        self.engine.abort_all()

    def limits(self) -> Optional[Limits]:
        """The engine's batching as vLLM resolved it (its config, read through the worker's engine);
        None for an engine that does not say (a stand-in)."""
        vc = getattr(getattr(self.engine, "engine", None), "vllm_config", None)
        if vc is None:
            return None
        sched, cache = vc.scheduler_config, vc.cache_config
        if not sched.max_num_batched_tokens or not cache.block_size:
            return None
        caching = bool(cache.enable_prefix_caching)
        return Limits(int(sched.max_num_seqs), int(sched.max_num_batched_tokens), int(cache.block_size), caching)

    def work(self) -> list[Work]:
        """The finished requests in the order they were sent, as the replay takes them."""
        out = []
        for rid in self.sent:
            if rid in self.finished:
                prompt, cached, output = self.finished[rid]
                out.append(Work(max(1, prompt - cached), output))
        return out

    def stats(self, generate_seconds: float) -> Optional[StepStats]:
        """The rung's steps against their replay; None without the engine's batching limits."""
        lim = self.limits()
        if lim is None or not self.durations:
            return None
        work = self.work()
        s = measure_steps(
            self.durations, list(steps(work, lim.max_num_seqs, lim.max_num_batched_tokens)), generate_seconds
        )
        s.requests = len(work)
        return s
