"""The full run's engine work, counted over the whole corpus on the login node (no engine): per shard
the requests the engine gets (identical rows of a shard share one), the prompt tokens it computes
(minus the whole KV blocks an earlier request on the same engine computed: the prefix cache), and
its batches replayed (tune/batching.py) with output lengths drawn from the pilot's. The pilot's
own shares of repeated prompts and shared prefixes differ from the corpus's (a 256-row pilot meets
a template's head as often, a description's common beginnings far less), so they are counted here
rather than taken from it."""

from __future__ import annotations

import random
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from batchinfer.engine.stream import first_window_rows, window_rows
from batchinfer.tune.batching import Limits, Load, Work, load
from batchinfer.tune.sample import GRAIN, Prompts

# Requests of one shard replayed at most; a larger shard's totals are scaled from its first ones
# (past a few waves of max_num_seqs each request adds the same), so a million-row corpus replays
# in seconds.
REPLAY_REQUESTS = 40_000


@dataclass(frozen=True)
class FullRun:
    """What the full run asks of its engines."""

    load: Load  # replayed steps, decode tokens and prompt tokens computed, every shard
    rows: int
    requests: int  # sent to an engine
    prompt_tokens: int  # of the requests sent
    cached_tokens: int  # of those, served from the prefix cache
    output_mean: float  # mean output tokens per request drawn for the replay
    in_flight: int = (
        0  # sequences its engine runs at once while a shard lasts: max_num_seqs, or its largest shard's requests
    )

    def filled_by(self, requests: int) -> bool:
        """Whether a rung of this many requests runs as many sequences at once as the full run does
        (its steps then hold what the full run's hold)."""
        return requests >= self.in_flight

    @property
    def duplicate_share(self) -> float:
        """Share of rows that took an identical row's answer within their shard."""
        return 1 - self.requests / self.rows if self.rows else 0.0

    @property
    def prefix_share(self) -> float:
        """Share of the prompt tokens sent that the prefix cache served."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def engine_groups(shards: int, shards_per_engine: Optional[int]) -> list[list[int]]:
    """Shards in the order each engine runs them: one engine for all (None: a local run with one
    engine), else consecutive groups of shards_per_engine (an array task's shards)."""
    if shards_per_engine is None:
        return [list(range(shards))]
    return [list(range(a, min(shards, a + shards_per_engine))) for a in range(0, shards, shards_per_engine)]


def cached_tokens(blocks: array, length: int, block_size: int, seen: set[int]) -> int:
    """Prompt tokens of one request the prefix cache serves: its leading whole blocks an earlier
    request computed (never the last token: vLLM computes at least one); then its own whole
    blocks join the cache."""
    step = block_size // GRAIN
    mine = [blocks[k] for k in range(step - 1, len(blocks), step)]  # the hash of each whole block's prefix
    hit = 0
    for h in mine[: max(0, length - 1) // block_size]:
        if h not in seen:
            break
        hit += 1
    seen.update(mine)
    return hit * block_size


def _window_order(members: list[tuple[tuple[int, int], int]], max_num_seqs: int) -> list[int]:
    """Request indices in the worker's order: its windows of rows (engine/stream.py), each sorted by
    its shared head (first 32 tokens) and length (engine/feed.py's work_order)."""
    out: list[int] = []
    first, size = first_window_rows(max_num_seqs), window_rows(max_num_seqs)
    start = 0
    while start < len(members):
        stop = start + (first if start == 0 else size)
        out += [i for _, i in sorted(members[start:stop])]
        start = stop
    return out


def full_run(
    prompts: Prompts,
    shards: Sequence[tuple[int, int]],
    shards_per_engine: Optional[int],
    limits: Limits,
    output_lengths: Sequence[int],
    seed: int,
    prompt_per_request: Optional[float] = None,
) -> FullRun:
    """The full run's engine work: every shard's requests, prompt tokens computed and batches.
    Without token ids (a corpus past sample.EXACT_ROWS, lengths in characters) each request
    computes prompt_per_request tokens (the pilot's)."""
    if limits.block_size % GRAIN:
        raise ValueError(f"block size {limits.block_size}: a multiple of {GRAIN} is expected")
    rng = random.Random(seed)
    lengths = list(output_lengths) or [0]
    total = Load()
    requests = prompt = cached = 0
    drawn = 0
    widest = 0  # requests of the largest shard
    for group in engine_groups(len(shards), shards_per_engine):
        seen: set[int] = set()
        for s in group:
            start, stop = shards[s]
            firsts: dict[str, int] = {}
            for i in range(start, stop):
                if prompts.lengths[i] > 0 and not prompts.keys[i].startswith("error-row-"):
                    firsts.setdefault(prompts.keys[i], i)
            rows = list(firsts.values())
            requests += len(rows)
            widest = max(widest, len(rows))
            heads = [_head(prompts, i) for i in rows]
            order = _window_order(list(zip(heads, rows, strict=True)), limits.max_num_seqs)
            work = []
            for i in order:
                n = prompts.lengths[i]
                if prompts.prefixes is None:  # no token ids: the pilot's computed prompt tokens per request
                    n, hit = max(1, round(prompt_per_request or 1)), 0
                elif limits.prefix_caching:
                    hit = cached_tokens(prompts.prefixes[i], n, limits.block_size, seen)
                else:
                    hit = 0
                prompt += n
                cached += hit
                work.append(Work(n - hit, rng.choice(lengths)))
            replayed = work[:REPLAY_REQUESTS]
            drawn += sum(w.output for w in work)
            part = load(replayed, limits.max_num_seqs, limits.max_num_batched_tokens)
            if len(work) > len(replayed):  # past REPLAY_REQUESTS each request adds what the replayed ones did
                part = part.scaled(len(work) / len(replayed))
            prefill = sum(w.prompt for w in work)
            total = total + Load(part.steps + 1, part.decodes, prefill)  # + the shard's last, empty step
    in_flight = min(limits.max_num_seqs, widest)
    return FullRun(total, sum(b - a for a, b in shards), requests, prompt, cached, drawn / max(1, requests), in_flight)


def _head(prompts: Prompts, i: int) -> tuple[int, int]:
    """A request's place in work order: the hash of its first 32 tokens, then its length."""
    p = prompts.prefixes[i] if prompts.prefixes is not None else None
    head = p[1] if p is not None and len(p) > 1 else hash(prompts.keys[i])
    return head, prompts.lengths[i]
