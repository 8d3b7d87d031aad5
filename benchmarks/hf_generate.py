"""(c) Hugging Face transformers `generate` in batches: what a naive user writes.

usage: python hf_generate.py ROWS.jsonl MODEL MAX_TOKENS [--system S] [--batch 16] [--limit N]
prints one JSON line: startup, generate seconds, prompt and output tokens (no structured outputs).
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
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--limit", type=int, default=8)
    # The dtype batchinfer's `auto` gives on this CPU, so both sides compute the same way.
    p.add_argument("--dtype", default=own_choice(gpu=False)["dtype"])
    a = p.parse_args()
    t0 = time.perf_counter()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.model, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=getattr(torch, a.dtype)).eval()
    startup = time.perf_counter() - t0
    rows = [json.loads(line) for line in open(a.rows)][: a.limit]
    system = [{"role": "system", "content": a.system}] if a.system else []
    prompts = [
        tok.apply_chat_template(
            [*system, {"role": "user", "content": r["text"]}], tokenize=False, add_generation_prompt=True
        )
        for r in rows
    ]
    prompt_tokens = output_tokens = 0
    t1 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), a.batch):
            enc = tok(prompts[i : i + a.batch], return_tensors="pt", padding=True, add_special_tokens=False)
            out = model.generate(**enc, max_new_tokens=a.max_tokens, do_sample=False, pad_token_id=tok.eos_token_id)
            new = out[:, enc["input_ids"].shape[1] :]
            prompt_tokens += int(enc["attention_mask"].sum())
            output_tokens += int((new != tok.eos_token_id).sum())
    generate = time.perf_counter() - t1
    print(
        json.dumps(
            {
                "startup": startup,
                "generate": generate,
                "rows": len(rows),
                "prompt_tokens": prompt_tokens,
                "output_tokens": output_tokens,
            }
        )
    )


if __name__ == "__main__":
    main()
