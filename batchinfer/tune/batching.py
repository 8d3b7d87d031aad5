"""The engine's batches replayed without an engine: which requests a continuous-batching scheduler
puts in each step, as vLLM's does (running requests first, one token each while decoding, the rest
of a prompt while prefilling; then waiting requests in the order they came while fewer than
max_num_seqs run and the step's token budget, max_num_batched_tokens, lasts; prompts chunked). Per
step: the sequences decoding and the prompt tokens computed, what a step's cost depends on
(tune/costmodel.py). Pure Python, no engine: the login node replays the full run with it."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    """An engine's batching as it resolved it: sequences and tokens a step holds, its KV block size
    and whether it caches prefixes."""

    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    prefix_caching: bool


@dataclass(frozen=True)
class Work:
    """One request as the engine sees it: prompt tokens it computes (after prefix-cache hits; at
    least one, vLLM always computes the last) and output tokens (0: a pooling request)."""

    prompt: int
    output: int


@dataclass(frozen=True)
class Load:
    """A replay's totals: engine steps, decode tokens (one per decoding sequence and step) and
    prompt tokens computed."""

    steps: int = 0
    decodes: int = 0
    prefill: int = 0

    def __add__(self, other: Load) -> Load:
        return Load(self.steps + other.steps, self.decodes + other.decodes, self.prefill + other.prefill)

    def scaled(self, k: float) -> Load:
        """These totals times k (rounded): a replay of part of a run scaled to all of it."""
        return Load(round(self.steps * k), round(self.decodes * k), round(self.prefill * k))


def steps(work: Sequence[Work], max_num_seqs: int, budget: int) -> Iterator[tuple[int, int]]:
    """(sequences decoding, prompt tokens computed) of every step that serves `work`, sent in this
    order with the engine's queue never empty until the last was sent (the worker keeps about
    2 x max_num_seqs in flight). A request's step that computes its last prompt token gives its
    first output token; each later step one more."""
    if max_num_seqs < 1 or budget < 1:
        raise ValueError(f"max_num_seqs {max_num_seqs} and max_num_batched_tokens {budget} must be positive")
    waiting = deque(work)
    running: list[list[int]] = []  # [prompt tokens left, output tokens left]
    while waiting or running:
        left, decodes, prefill = budget, 0, 0
        kept: list[list[int]] = []
        for r in running:
            if left == 0:
                kept.append(r)
                continue
            if r[0] > 0:  # a prompt chunked over steps: its rest first
                take = min(r[0], left)
                r[0] -= take
                left -= take
                prefill += take
                if r[0] == 0 and r[1] > 0:
                    r[1] -= 1
            else:
                left -= 1
                decodes += 1
                r[1] -= 1
            if r[0] > 0 or r[1] > 0:
                kept.append(r)
        seats = max_num_seqs - len(running)  # a request finishing in this step still holds its seat
        while waiting and seats > 0 and left > 0:
            w = waiting.popleft()
            seats -= 1
            take = min(max(1, w.prompt), left)
            left -= take
            prefill += take
            r = [max(1, w.prompt) - take, w.output]
            if r[0] == 0 and r[1] > 0:
                r[1] -= 1
            if r[0] > 0 or r[1] > 0:
                kept.append(r)
        running = kept
        yield decodes, prefill


def load(work: Sequence[Work], max_num_seqs: int, budget: int) -> Load:
    """The totals of steps(work, ...)."""
    n = d = p = 0
    for decodes, prefill in steps(work, max_num_seqs, budget):
        n += 1
        d += decodes
        p += prefill
    return Load(n, d, p)
