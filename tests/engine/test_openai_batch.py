"""OpenAI Batch API files in and out, through the real engine (shared in-process engine)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support.openai_batch import request, run_batch

from batchinfer.errors import InputError

pytestmark = pytest.mark.engine


def test_openai_batch_in_openai_batch_out(tmp_path: Path, tiny_model_path: Path, engine: Any) -> None:
    lines = (
        request("req-1", {"model": "x", "messages": [{"role": "user", "content": "the lazy dog"}], "max_tokens": 3})
        + request(
            "req-2",
            {
                "model": "x",
                "messages": [{"role": "user", "content": "hello world"}],
                "n": 2,
                "temperature": 1.0,
                "seed": 3,
            },
        )
        + request("req-3", {"model": "x", "prompt": "quick brown fox"}, url="/v1/completions")
        + request("req-4", {"model": "x", "messages": [{"role": "user", "content": "physics"}]})
    )
    out = run_batch(tmp_path, tiny_model_path, engine, lines)
    assert [o["custom_id"] for o in out] == ["req-1", "req-2", "req-3", "req-4"]
    assert len({o["id"] for o in out}) == 4 and all(o["error"] is None for o in out)
    first = out[0]["response"]
    assert first["status_code"] == 200 and first["body"]["object"] == "chat.completion"
    assert first["body"]["usage"]["completion_tokens"] == 3  # the request's own max_tokens
    assert first["body"]["usage"]["total_tokens"] == first["body"]["usage"]["prompt_tokens"] + 3
    choice = first["body"]["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    assert choice["message"]["content"].strip().startswith("dog")
    assert [c["index"] for c in out[1]["response"]["body"]["choices"]] == [0, 1]  # n=2
    completion = out[2]["response"]["body"]
    assert completion["object"] == "text_completion" and completion["choices"][0]["text"].strip().startswith("fox")
    assert out[3]["response"]["body"]["usage"]["completion_tokens"] == 5  # the config's max_tokens


def test_malformed_openai_request_names_the_line(tmp_path: Path, tiny_model_path: Path, engine: Any) -> None:
    lines = request("ok", {"messages": [{"role": "user", "content": "hi"}]}) + request("bad", {"messages": "hi"})
    with pytest.raises(InputError, match=r"batch.jsonl:2: body.messages must be a list"):
        run_batch(tmp_path, tiny_model_path, engine, lines)
