"""An input row -> a pooling request (embed, classify, score): its text(s) as token ids that fit
the model's window, special tokens kept, and the per-request extras the engine needs (JSON)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from batchinfer.config.schema import Config
from batchinfer.errors import InputError
from batchinfer.requests.prompts import PromptBuilder, RowError

Encode = Callable[[str], list[int]]
# encode a (query, document) pair as one input: (ids, index of the document's first token), the
# document cut to fit limit when one is given
EncodePair = Callable[[str, str, "int | None"], tuple[list[int], int]]


def special_tokens(encode: Encode) -> tuple[list[int], list[int]]:
    """The tokens the tokenizer puts around every text, before and after: ([CLS], [SEP]) for BERT."""
    empty, one = encode(""), encode("a")
    n = 0
    while n < min(len(empty), len(one)) and empty[n] == one[n]:
        n += 1
    return empty[:n], empty[n:]


def fit(ids: list[int], limit: int, policy: str, around: tuple[list[int], list[int]]) -> list[int]:
    """Apply prompt.overlong to a pooling input longer than max_model_len (special tokens counted):
    truncation cuts the text, keeping the special tokens around it."""
    if len(ids) <= limit:
        return ids
    msg = f"text has {len(ids)} tokens, special tokens included; model.max_model_len is {limit}"
    if policy == "fail":
        raise InputError(f"{msg} (prompt.overlong=fail); set prompt.overlong=truncate_right, as encoders expect")
    if policy == "error_row":
        raise RowError("overlong", f"{msg}; set prompt.overlong=truncate_right|truncate_left")
    head, tail = len(around[0]), len(around[1])
    body = ids[head : len(ids) - tail]
    keep = max(limit - head - tail, 0)
    body = body[len(body) - keep :] if policy == "truncate_left" else body[:keep]
    return ids[:head] + body + ids[len(ids) - tail :]


def pooling_request(
    cfg: Config,
    builder: PromptBuilder,
    row: dict[str, Any],
    index: int,
    encode: Encode,
    limit: int,
    around: tuple[list[int], list[int]],
    encode_pair: EncodePair | None = None,
) -> tuple[list[int], str]:
    """(token ids, engine extras as JSON) of a row; a bad row raises RowError.

    score sends a cross-encoder the pair as one input (extras: where the document starts); a
    bi-encoder gets both texts' ids one after the other (extras: where the second starts) and the
    engine compares their embeddings."""
    task, policy = cfg.task, cfg.prompt.overlong
    if task.name != "score":
        return fit(encode(builder.build(row)), limit, policy, around), ""  # type: ignore[arg-type]
    query, document = builder.fill(task.query or "", row), builder.fill(task.document or "", row)
    if encode_pair is not None:
        ids, boundary = encode_pair(query, document, None)
        if len(ids) > limit:
            if policy in ("fail", "error_row"):
                fit(ids, limit, policy, around)  # raises, naming the policy
            ids, boundary = encode_pair(query, document, limit)
        return ids, json.dumps({"boundary": boundary})
    q, d = (fit(encode(t), limit, policy, around) for t in (query, document))
    return q + d, json.dumps({"pair": len(q)})
