"""What the engine gives back for a finished request (Completion), and a bi-encoder pair's parts:
plain records, nothing of vllm imported."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional


@dataclass
class Completion:
    """A finished request: every sample's text and the token counts."""

    request_id: str
    texts: list[str]
    finish_reason: Optional[str]
    prompt_tokens: int
    output_tokens: int
    reasoning: Optional[list[Optional[str]]] = None  # per sample, when model.reasoning_parser is set
    logprob: Optional[float] = None  # first sample's cumulative logprob, when logprobs were asked for
    cached_tokens: Optional[int] = None  # prompt tokens served from the prefix cache (None: not reported)
    pooled: Any = None  # a pooling request's float32 vector (numpy): embedding, class probabilities, score


PAIR_SEP = "#pair"


@dataclass
class PairParams:
    """A bi-encoder score: the first `split` token ids are one text, the rest the other."""

    split: int
    embed: Any  # PoolingParams(task="embed")


def cosine(request_id: str, a: Completion, b: Completion) -> Completion:
    """A bi-encoder pair's score: the cosine similarity of its two embeddings."""
    import numpy as np

    va, vb = a.pooled.astype(np.float64), b.pooled.astype(np.float64)
    cos = float(va @ vb / ((np.linalg.norm(va) * np.linalg.norm(vb)) or 1.0))
    return Completion(
        request_id=request_id,
        texts=[],
        finish_reason=None,
        prompt_tokens=a.prompt_tokens + b.prompt_tokens,
        output_tokens=0,
        pooled=np.array([cos], dtype=np.float32),
    )


def pooled_completion(out: Any) -> Completion:
    """A finished pooling request: its vector as float32 numpy (a score is a vector of one)."""
    data = out.outputs.data
    return Completion(
        request_id=out.request_id,
        texts=[],
        finish_reason=None,
        prompt_tokens=len(out.prompt_token_ids or []),
        output_tokens=0,
        cached_tokens=getattr(out, "num_cached_tokens", None),
        pooled=data.float().cpu().numpy().reshape(-1),
    )


def generated_completion(out: Any, split: Optional[Callable[[str], tuple[Optional[str], str]]] = None) -> Completion:
    """A finished generation request; split: the reasoning parser's (reasoning, answer) of a sample."""
    samples = out.outputs
    parts = [split(s.text) if split else (None, s.text) for s in samples]
    return Completion(
        request_id=out.request_id,
        texts=[answer for _, answer in parts],
        finish_reason=samples[0].finish_reason if samples else None,
        prompt_tokens=len(out.prompt_token_ids or []),
        output_tokens=sum(len(s.token_ids) for s in samples),
        reasoning=[r for r, _ in parts] if split else None,
        logprob=samples[0].cumulative_logprob if samples else None,
        # Set by the scheduler for every request, also with stat logging off (LLM's default).
        cached_tokens=getattr(out, "num_cached_tokens", None),
    )
