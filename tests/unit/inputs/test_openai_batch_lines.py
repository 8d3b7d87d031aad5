"""OpenAI Batch request lines: multi-part text content is joined; a line this run cannot honour
(a non-text part, a tool-call turn, tools, logprobs, an unknown body field) is an error row naming
the field, never a refused file nor a silently dropped field; response_format becomes the row's
own structured outputs (issue 26)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support.fake_engine import FakeEngine, fake_overrides, keyed
from support.openai_batch import request

from batchinfer.config.compose import compose
from batchinfer.errors import InputError
from batchinfer.inputs.convert import open_input
from batchinfer.inputs.openai_batch import REFUSED, ROW_SAMPLING, request_row
from batchinfer.insight.row_check import check_rows
from batchinfer.launch.local import run_shards
from batchinfer.rundir.merge import merge
from batchinfer.rundir.prepare import prepare

USER = {"role": "user", "content": "hi"}
SCHEMA = {"type": "string", "enum": ["yes", "no"]}


def line(body: dict[str, Any], url: str = "/v1/chat/completions") -> dict[str, Any]:
    """request_row of one request with this body."""
    return request_row({"custom_id": "c1", "url": url, "body": body}, "batch.jsonl:1")


def test_text_parts_are_joined_as_vllm_joins_them() -> None:
    parts = [{"type": "text", "text": "Summarise:"}, {"type": "text", "text": "the quick brown fox"}]
    row = line(
        {
            "messages": [
                {"role": "system", "content": [{"type": "text", "text": "Be brief"}]},
                {"role": "user", "content": parts},
            ]
        }
    )
    assert row["messages"] == [
        {"role": "system", "content": "Be brief"},
        {"role": "user", "content": "Summarise:\nthe quick brown fox"},
    ]
    assert row[REFUSED] is None and row[ROW_SAMPLING] is None


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "what is it?"},
                            {"type": "input_audio", "input_audio": {"data": "x", "format": "wav"}},
                        ],
                    }
                ]
            },
            "body.messages[0].content[1] is a 'input_audio' part",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a.png"}}]},
                    {"role": "assistant", "content": "a cat"},
                    {"role": "user", "content": "and now?"},
                ]
            },
            "image_url parts in body.messages[0]: one image per request, in the last user message",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": "a.png"}},
                            {"type": "image_url", "image_url": "b.png"},
                        ],
                    }
                ]
            },
            "image_url parts in body.messages[0], body.messages[0]: one image per request",
        ),
        (
            {
                "messages": [
                    USER,
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                    },
                    {"role": "tool", "tool_call_id": "t1", "content": "42"},
                ]
            },
            "body.messages[1].tool_calls: an assistant's tool calls cannot run here",
        ),
        (
            {"messages": [USER, {"role": "tool", "tool_call_id": "t1", "content": "42"}]},
            "body.messages[1].role is 'tool'",
        ),
        (
            {"messages": [USER], "tools": [{"type": "function", "function": {"name": "f"}}]},
            "body.tools: tool calling cannot run here",
        ),
        ({"messages": [USER], "tool_choice": "required"}, "body.tool_choice: tool calling cannot run here"),
        ({"messages": [USER], "logprobs": True, "top_logprobs": 2}, "body.logprobs: token logprobs are not written"),
        ({"messages": [USER], "top_logprobs": 2}, "body.top_logprobs: token logprobs are not written"),
        ({"prompt": "hi", "logprobs": 3}, "body.logprobs: token logprobs are not written"),
        ({"prompt": "hi", "echo": True}, "body.echo: not supported by batchinfer, and it could change the answer"),
        ({"messages": [USER], "reasoning_effort": "high"}, "body.reasoning_effort: not supported by batchinfer"),
        (
            {"messages": [USER], "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "body.response_format.json_schema.schema must be",
        ),
        ({"messages": [USER], "response_format": {"type": "xml"}}, "body.response_format type 'xml' is not supported"),
        ({"input": "hi", "dimensions": 8}, "body.dimensions: a request cannot choose its own dimensions"),
        ({"input": "hi", "encoding_format": "base64"}, "body.encoding_format: embeddings are written as floats"),
    ],
)
def test_what_cannot_run_is_refused_naming_the_field(body: dict[str, Any], field: str) -> None:
    url = "/v1/completions" if "prompt" in body else "/v1/embeddings" if "input" in body else "/v1/chat/completions"
    row = line(body, url)
    assert row[REFUSED] is not None and row[REFUSED].startswith(field), row[REFUSED]
    assert row["messages"] is None and row[ROW_SAMPLING] is None  # nothing of it runs


def test_fields_that_ask_nothing_pass_and_sampling_fields_are_kept() -> None:
    body = {
        "model": "gpt-4o",
        "user": "u1",
        "messages": [USER],
        "logprobs": False,
        "top_logprobs": 0,
        "tools": [],
        "tool_choice": "none",
        "stream": False,
        "max_completion_tokens": 7,
        "stop": "###",
        "top_k": 5,
        "response_format": {"type": "text"},
    }
    row = line(body)
    assert row[REFUSED] is None
    assert json.loads(row[ROW_SAMPLING]) == {"max_tokens": 7, "stop": ["###"], "top_k": 5}


def test_response_format_is_the_rows_structured_outputs() -> None:
    schema = line(
        {
            "messages": [USER],
            "response_format": {"type": "json_schema", "json_schema": {"name": "yn", "schema": SCHEMA, "strict": True}},
        }
    )
    assert json.loads(schema[ROW_SAMPLING]) == {"structured_outputs": {"json": SCHEMA}}
    obj = line({"messages": [USER], "response_format": {"type": "json_object"}, "max_tokens": 9})
    assert json.loads(obj[ROW_SAMPLING]) == {"max_tokens": 9, "structured_outputs": {"json": {"type": "object"}}}


def test_a_malformed_line_still_names_its_line() -> None:
    with pytest.raises(InputError, match=r"batch.jsonl:1: body.messages\[0\].content must be a string or a list"):
        line({"messages": [{"role": "user", "content": 5}]})
    with pytest.raises(InputError, match=r"batch.jsonl:1: body.messages\[0\].content\[0\] must be"):
        line({"messages": [{"role": "user", "content": [{"type": "text"}]}]})


class RecordingEngine(FakeEngine):
    """The fake engine, keeping the sampling each request was added with."""

    def __init__(self) -> None:
        super().__init__()
        self.params: dict[tuple[int, ...], Any] = {}

    def add(self, request_id: str, token_ids: list[int], params: Any) -> None:
        self.params[tuple(token_ids)] = params
        super().add(request_id, token_ids, params)


def test_a_file_with_such_lines_runs_each_line_its_own_way(tmp_path: Path) -> None:
    """Through prepare, the worker, merge and validate: error rows where a field cannot be honoured,
    answers elsewhere, response_format's schema in the engine's sampling of that row only."""
    parts = [{"type": "text", "text": "quick"}, {"type": "text", "text": "fox"}]
    batch = tmp_path / "batch.jsonl"
    batch.write_text(
        request("plain", {"messages": [{"role": "user", "content": "lazy dog"}]})
        + request("parts", {"messages": [{"role": "user", "content": parts}]})
        + request(
            "image",
            {"messages": [{"role": "user", "content": [*parts, {"type": "image_url", "image_url": {"url": "u"}}]}]},
        )
        + request(
            "tools",
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "function", "function": {"name": "f"}}],
            },
        )
        + request("logprobs", {"messages": [{"role": "user", "content": "y"}], "logprobs": True})
        + request(
            "schema",
            {
                "messages": [{"role": "user", "content": "yes?"}],
                "response_format": {"type": "json_schema", "json_schema": {"name": "yn", "schema": SCHEMA}},
            },
        )
    )
    cfg = compose(fake_overrides(tmp_path, batch))
    run = prepare(cfg)
    eng = RecordingEngine()
    run_shards(run, [0], engine=keyed(eng, run))
    merge(run)
    out = {o["custom_id"]: o for o in map(json.loads, run.output_path.read_text().splitlines())}
    assert list(out) == ["plain", "parts", "image", "tools", "logprobs", "schema"]
    for cid, text in [("plain", "lazy dog"), ("parts", "quick\nfox"), ("schema", "yes?")]:
        assert out[cid]["error"] is None
        answer = out[cid]["response"]["body"]["choices"][0]["message"]["content"]
        assert answer == FakeEngine.answer(eng.encode([{"content": text}]))  # its own prompt, parts joined
    assert out["image"]["error"]["code"] == "image"  # its image_url runs: here, a file that is not there
    assert f"image {tmp_path / 'u'}: no such file" in out["image"]["error"]["message"]
    assert out["tools"]["error"]["code"] == "unsupported" and "body.tools" in out["tools"]["error"]["message"]
    assert out["logprobs"]["error"]["code"] == "unsupported" and "body.logprobs" in out["logprobs"]["error"]["message"]
    schema_ids = tuple(eng.encode([{"content": "yes?"}]))
    assert eng.params[schema_ids]["structured_outputs"] == {"json": SCHEMA}
    assert all(p["structured_outputs"]["json"] is None for ids, p in eng.params.items() if ids != schema_ids)
    # validate predicts the same error rows
    found = check_rows(run.config, open_input(run.input_dir), FakeEngine(), 1000)
    assert {k: v["count"] for k, v in found.errors.kinds.items()} == {"unsupported": 2, "image": 1}
    messages = [e["message"] for e in found.errors.kinds["unsupported"]["examples"]]
    assert [m.split(": ", 1)[1][:20] for m in messages] == [
        "body.tools: tool cal",
        "body.logprobs: token",
    ]
