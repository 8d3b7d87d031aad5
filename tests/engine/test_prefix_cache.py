"""On CPU the engine keeps its KV cache in 32-token blocks, so a shared head shorter than vLLM's
CPU default block (128 tokens) is served from the prefix cache."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support.corpus import WORDS, assert_own_output, read_output, write_corpus
from support.runs import run_overrides as overrides

from batchinfer.config.compose import compose
from batchinfer.engine.engine_args import CPU_BLOCK_SIZE
from batchinfer.launch.local import run_local

ROWS = 40
HEAD = " ".join(WORDS * 6)  # the system prompt every row shares


def shared_prefix(ids: list[list[int]]) -> int:
    """Tokens every row's prompt begins with."""
    n = 0
    while all(len(x) > n and x[n] == ids[0][n] for x in ids):
        n += 1
    return n


@pytest.mark.engine
def test_a_shared_head_shorter_than_vllms_cpu_block_hits_the_prefix_cache(
    tmp_path: Path, tiny_model_path: Path, engine: Any
) -> None:
    assert engine.engine.vllm_config.cache_config.block_size == CPU_BLOCK_SIZE == 32
    corpus = tmp_path / "c.jsonl"
    rows = write_corpus(corpus, ROWS, seed=11, min_words=2, max_words=4)
    run = run_local(
        compose(overrides(tiny_model_path, corpus, tmp_path / "run", f"prompt.system={HEAD}")), engine=engine
    )
    ids = [engine.encode([{"role": "system", "content": HEAD}, {"role": "user", "content": r["text"]}]) for r in rows]
    shared = shared_prefix(ids)
    assert 2 * CPU_BLOCK_SIZE <= shared < 128, shared  # vLLM's CPU default block (128) would hold none of it
    (done,) = run.path.glob("shards/*/DONE.json")
    cache = json.loads(done.read_text())["prefix_cache"]
    distinct = {tuple(x) for x in ids}  # identical rows are computed once
    assert cache["queries"] == sum(len(x) for x in distinct) and len(distinct) > 24
    # Every request after the first batch (max_num_seqs=16) finds the shared whole blocks computed;
    # hits come in whole blocks.
    whole = shared // CPU_BLOCK_SIZE * CPU_BLOCK_SIZE
    assert cache["hits"] % CPU_BLOCK_SIZE == 0 and cache["hits"] >= whole * (len(distinct) - 16), (cache, whole)
    out = read_output(run.path)
    assert [o["id"] for o in out] == [r["id"] for r in rows]
    for o, r in zip(out, rows, strict=True):
        assert_own_output(o, r["text"])  # served from the cache, each row still gets its own answer
