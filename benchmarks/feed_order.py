"""How the worker feeds the engine, apart from everything else: the same distinct requests (token
ids, greedy) on one engine, fed

  A  all at once in input order (what one `LLM.chat(all rows)` does),
  B  in the worker's work order (shared first 32 tokens, then length) with 2 x max_num_seqs in flight,
  C  in input order with 2 x max_num_seqs in flight,
  D  in work order, all at once.

Each variant's seconds from its first add to its last result, output tokens/s and engine steps.
usage: python benchmarks/feed_order.py ROWS.jsonl MODEL ROWS MAX_TOKENS [--variants A,B,C] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any


def feed(engine: Any, params: Any, order: list[list[int]], cap: int, tag: str) -> dict[str, Any]:
    """Add requests while fewer than cap are in flight, step until all are done."""
    queue, in_flight, added, tokens, steps = list(order), 0, 0, 0, 0
    t0 = time.perf_counter()
    while queue or in_flight:
        while queue and in_flight < cap:
            (prompt,) = engine.renderer.render_cmpl([{"prompt_token_ids": queue.pop(0)}])
            engine.add_request(f"{tag}-{added}", prompt, params)
            added += 1
            in_flight += 1
        for out in engine.step():
            if out.finished:
                in_flight -= 1
                tokens += len(out.outputs[0].token_ids)
        steps += 1
    seconds = time.perf_counter() - t0
    return {"variant": tag, "seconds": round(seconds, 2), "out_tok_s": round(tokens / seconds, 1), "steps": steps}


def main() -> None:
    """Build the requests once, run the variants in turn on one engine, print one JSON line each."""
    ap = argparse.ArgumentParser()
    ap.add_argument("rows")
    ap.add_argument("model")
    ap.add_argument("n", type=int)
    ap.add_argument("max_tokens", type=int)
    ap.add_argument("--variants", default="A,B,C")
    ap.add_argument("--repeats", type=int, default=1)
    a = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from batchinfer.engine.feed import work_order
    from batchinfer.requests.request import RequestKey

    llm = LLM(model=a.model, dtype="float32", max_model_len=2048, enforce_eager=True, seed=0)
    tok, engine = llm.get_tokenizer(), llm.llm_engine
    rows = [json.loads(line) for line in open(a.rows)][: a.n]
    chats = [[{"role": "user", "content": r["text"]}] for r in rows]
    ids = [
        tok.encode(tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
        for c in chats
    ]
    distinct = list({tuple(t): t for t in ids}.values())  # what the worker computes: each prompt once
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens)
    params.output_kind = RequestOutputKind.FINAL_ONLY  # as LLM.generate and the worker ask
    seqs = engine.vllm_config.scheduler_config.max_num_seqs
    # the worker's own order (batchinfer/engine/feed.py), not a copy of it
    ordered = sorted(distinct, key=lambda t: work_order(RequestKey(tuple(t), "")))
    plans = {"A": (distinct, 10**9), "B": (ordered, 2 * seqs), "C": (distinct, 2 * seqs), "D": (ordered, 10**9)}
    block = engine.vllm_config.cache_config.block_size
    print(json.dumps({"max_num_seqs": seqs, "block_size": block, "requests": len(distinct)}), flush=True)
    for rep in range(a.repeats):
        for v in a.variants.split(","):
            order, cap = plans[v]
            print(json.dumps(feed(engine, params, order, cap, f"{v}{rep}")), flush=True)


if __name__ == "__main__":
    main()
