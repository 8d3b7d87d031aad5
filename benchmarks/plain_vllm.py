"""(a) Plain vLLM as the classic Slurm batch script runs it: one LLM.chat over all rows.

usage: python plain_vllm.py ROWS.jsonl MODEL MAX_TOKENS [--system S] [--choice a,b] [--max-model-len N] [--block-size N]
prints one JSON line: startup, generate seconds, prompt and output tokens.
"""

from __future__ import annotations

import argparse
import json
import time

from batchinfer.engine.dtype import own_choice


def main() -> None:
    """Run and report."""
    p = argparse.ArgumentParser()
    p.add_argument("rows")
    p.add_argument("model")
    p.add_argument("max_tokens", type=int)
    p.add_argument("--system")
    p.add_argument("--choice")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--block-size", type=int, help="KV block size (vLLM's default when unset: 128 on CPU)")
    # The dtype batchinfer's `auto` gives on this CPU, so both sides compute the same way.
    p.add_argument("--dtype", default=own_choice(gpu=False)["dtype"])
    a = p.parse_args()
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    block = {"block_size": a.block_size} if a.block_size else {}
    llm = LLM(model=a.model, dtype=a.dtype, max_model_len=a.max_model_len, enforce_eager=True, seed=0, **block)
    startup = time.perf_counter() - t0
    rows = [json.loads(line) for line in open(a.rows)]
    so = StructuredOutputsParams(choice=a.choice.split(",")) if a.choice else None
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, structured_outputs=so)
    system = [{"role": "system", "content": a.system}] if a.system else []
    conversations = [[*system, {"role": "user", "content": r["text"]}] for r in rows]
    t1 = time.perf_counter()
    outs = llm.chat(conversations, params, use_tqdm=False)
    generate = time.perf_counter() - t1
    texts = [o.outputs[0].text for o in outs]
    with open(a.rows + ".plain-out.jsonl", "w") as f:
        for r, t in zip(rows, texts, strict=True):
            f.write(json.dumps({"id": r["id"], "text": t}) + "\n")
    print(
        json.dumps(
            {
                "startup": startup,
                "generate": generate,
                "rows": len(outs),
                "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
                "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            }
        )
    )


if __name__ == "__main__":
    main()
