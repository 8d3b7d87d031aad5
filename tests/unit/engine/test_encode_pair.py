"""The engine's cross-encoder pair: a pair whose query alone is longer than the window is an overlong
RowError where it is encoded, so PoolingRows makes it an `overlong` error row, not `rejected`
(issue 26). Only the model's tokenizer is loaded: no engine starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchinfer.engine.vllm_engine import Engine
from batchinfer.requests.prompts import RowError


def test_a_pair_that_cannot_be_cut_is_an_overlong_row_error(minilm: Path) -> None:
    from transformers import AutoTokenizer

    engine = Engine.__new__(Engine)  # encode_pair needs only the tokenizer
    engine.tokenizer = AutoTokenizer.from_pretrained(str(minilm))
    ids, start = engine.encode_pair("short query", "word " * 200, 32)  # the document is cut, the query kept
    assert len(ids) == 32 and engine.tokenizer.decode(ids[:start], skip_special_tokens=True) == "short query"
    with pytest.raises(RowError) as e:
        engine.encode_pair(" ".join(["query"] * 40), "doc", 16)
    assert e.value.kind == "overlong" and e.value.message.startswith("the pair cannot be cut to 16 tokens")
