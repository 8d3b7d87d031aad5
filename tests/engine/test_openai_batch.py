"""OpenAI Batch API files in and out, through the real engine (shared in-process engine)."""

from __future__ import annotations

import json
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


def test_each_line_runs_its_own_way_response_format_text_parts_and_error_rows(
    tmp_path: Path, tiny_model_path: Path, engine: Any
) -> None:
    """response_format constrains its own row only; text parts are joined as vLLM's server joins
    them; a line that cannot run is an error row naming the field, the others answered (issue 26)."""
    user = {"role": "user", "content": "the lazy dog"}
    yes_no = {"type": "json_schema", "json_schema": {"name": "yn", "schema": {"type": "string", "enum": ["yes", "no"]}}}
    parts = [{"type": "text", "text": "the lazy"}, {"type": "text", "text": "dog"}]
    image = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    lines = (
        request("schema", {"messages": [user], "max_tokens": 20, "response_format": yes_no})
        + request("plain", {"messages": [user], "max_tokens": 3})
        + request("parts", {"messages": [{"role": "user", "content": parts}], "max_tokens": 3})
        + request("joined", {"messages": [{"role": "user", "content": "the lazy\ndog"}], "max_tokens": 3})
        + request("image", {"messages": [{"role": "user", "content": [*parts, image]}]})
        + request("logprobs", {"messages": [user], "logprobs": True, "top_logprobs": 2})
    )
    out = {o["custom_id"]: o for o in run_batch(tmp_path, tiny_model_path, engine, lines)}
    assert list(out) == ["schema", "plain", "parts", "joined", "image", "logprobs"]

    def choice(cid: str) -> dict[str, Any]:
        assert out[cid]["error"] is None, out[cid]
        return out[cid]["response"]["body"]["choices"][0]

    assert json.loads(choice("schema")["message"]["content"]) in ("yes", "no")
    assert choice("schema")["finish_reason"] == "stop"
    assert choice("plain")["message"]["content"].strip().startswith("dog")  # unconstrained: the tiny model echoes
    assert choice("parts") == choice("joined")
    usage = [out[c]["response"]["body"]["usage"]["prompt_tokens"] for c in ("parts", "joined")]
    assert usage[0] == usage[1]
    assert out["image"]["error"]["code"] == "image" and out["image"]["response"] is None
    assert "https://example.com/a.png is an http URL: not fetched unless" in out["image"]["error"]["message"]
    assert out["logprobs"]["error"]["code"] == "unsupported"
    assert "body.logprobs: token logprobs are not written in the output" in out["logprobs"]["error"]["message"]
