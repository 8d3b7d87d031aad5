"""The OpenAI Batch API file formats: requests in (custom_id, url, body), responses out."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from batchinfer.errors import InputError

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
EMBEDDINGS_URL = "/v1/embeddings"  # runs with task=embed; the other urls with task=generate
RAW_PROMPT = "_raw_prompt"  # column of /v1/completions prompts (raw mode for that row)
ROW_SAMPLING = "_sampling"  # column of per-row SamplingParams overrides, as JSON
REFUSED = "_refused"  # column: why a request cannot run here, naming its field (an error row), or null
IMAGE_URL = "_image_url"  # column: a chat request's image_url part (a data: URL, a file path or URL), or null
# Body fields that are SamplingParams (OpenAI name -> vLLM name); the vLLM extensions among them
# (top_k, min_p, ...) are what vLLM's own OpenAI server takes as extra body parameters.
SAMPLING_FIELDS = {
    "max_tokens": "max_tokens",
    "max_completion_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "n": "n",
    "seed": "seed",
    "stop": "stop",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "top_k": "top_k",
    "min_p": "min_p",
    "min_tokens": "min_tokens",
    "repetition_penalty": "repetition_penalty",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
}
# Body fields that do not change the answer (bookkeeping, or meaningless in a batch file).
IGNORED_FIELDS = frozenset(
    {"model", "user", "metadata", "store", "service_tier", "stream", "stream_options", "parallel_tool_calls"}
    | {"prompt_cache_key", "safety_identifier", "encoding_format"}
)
# Tool calling (the request's functions in the prompt, calls parsed from the answer) does not run here.
TOOL_FIELDS = ("tools", "functions", "tool_choice", "function_call")
TEXT_HINT = "batchinfer runs text requests"
TEXT_FIELD = {CHAT_URL: "messages", COMPLETIONS_URL: "prompt", EMBEDDINGS_URL: "input"}
ASKS_NOTHING = (None, False, 0, "", [], {})  # a field with such a value changes nothing
SCHEMA = pa.schema(
    [
        ("custom_id", pa.string()),
        ("url", pa.string()),
        ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        (RAW_PROMPT, pa.string()),
        (ROW_SAMPLING, pa.string()),
        (REFUSED, pa.string()),
        (IMAGE_URL, pa.string()),
    ]
)


class Refused(Exception):
    """A well-formed request this run cannot honour: its row becomes an error row naming the field."""


def looks_like_openai_batch(first_line: str) -> bool:
    """Whether a JSONL line is an OpenAI Batch request."""
    try:
        obj = json.loads(first_line)
    except (ValueError, RecursionError):  # not JSON lines of requests: the reading says what it is
        return False
    return isinstance(obj, dict) and {"custom_id", "body"} <= set(obj)


def request_row(obj: Any, where: str) -> dict[str, Any]:
    """One request line -> a row of SCHEMA. A malformed request (no custom_id or body, an unknown
    url, messages that are not a list of {role, content}) is an InputError naming its line; a
    well-formed one this run cannot honour is a row whose REFUSED column names the field."""
    if not isinstance(obj, dict) or not isinstance(obj.get("custom_id"), str) or not isinstance(obj.get("body"), dict):
        raise InputError(f"{where}: an OpenAI batch request needs a string custom_id and a body object")
    body = obj["body"]
    url = obj.get("url") or (CHAT_URL if "messages" in body else COMPLETIONS_URL)
    if url not in (CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL):
        raise InputError(
            f"{where}: url {url!r} is not supported (only {CHAT_URL}, {COMPLETIONS_URL} and {EMBEDDINGS_URL})"
        )
    row: dict[str, Any] = {
        "custom_id": obj["custom_id"],
        "url": url,
        "messages": None,
        RAW_PROMPT: None,
        IMAGE_URL: None,
    }
    if url == EMBEDDINGS_URL:
        text = body.get("input")
        if isinstance(text, list) and len(text) == 1:
            text = text[0]
        # Not one string (several inputs, token ids): the row becomes an error row, the run goes on.
        row[RAW_PROMPT] = text if isinstance(text, str) else None
    elif url == CHAT_URL:
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages
        ):
            raise InputError(f"{where}: body.messages must be a list of {{role, content}} with string content")
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise InputError(f"{where}: body.prompt must be a string for {COMPLETIONS_URL}")
        row[RAW_PROMPT] = prompt
    try:
        if url == CHAT_URL:
            images: list[tuple[int, str]] = []
            row["messages"] = [
                chat_turn(m, f"body.messages[{i}]", where, images, i) for i, m in enumerate(body["messages"])
            ]
            row[IMAGE_URL] = request_image(body["messages"], images)
        sampling = body_sampling(body, url)
    except Refused as e:
        return dict(row, messages=None, **{RAW_PROMPT: None, ROW_SAMPLING: None, REFUSED: str(e), IMAGE_URL: None})
    return dict(row, **{ROW_SAMPLING: json.dumps(sampling, sort_keys=True) if sampling else None, REFUSED: None})


def chat_turn(
    m: dict[str, Any], name: str, where: str, images: Optional[list[tuple[int, str]]] = None, index: int = 0
) -> dict[str, str]:
    """One chat message -> {role, content}: text parts joined by a newline, as vLLM's server joins
    them; an image_url part's URL appended to images (with the message's index); a tool-call turn
    or another non-text part raises Refused naming the field."""
    role = m["role"]
    if role in ("tool", "function"):
        raise Refused(f"{name}.role is {role!r}: tool results cannot run here ({TEXT_HINT}, without tool calling)")
    for key in ("tool_calls", "function_call"):
        if m.get(key):
            raise Refused(f"{name}.{key}: an assistant's tool calls cannot run here ({TEXT_HINT})")
    content = m.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list) or not content:
        raise InputError(
            f"{where}: {name}.content must be a string or a list of content parts, got {json.dumps(content)}"
        )
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in ("text", None):
            raise InputError(f'{where}: {name}.content[{j}] must be {{"type": "text", "text": "..."}}')
        elif kind == "image_url" and images is not None:
            value = part.get("image_url")
            url = value.get("url") if isinstance(value, dict) else value
            if not isinstance(url, str):
                raise InputError(
                    f'{where}: {name}.content[{j}] must be {{"type": "image_url", "image_url": {{"url": "..."}}}}'
                )
            images.append((index, url))
        else:
            raise Refused(f"{name}.content[{j}] is a {kind!r} part: only text parts can run here ({TEXT_HINT})")
    return {"role": role, "content": "\n".join(texts)}


def request_image(messages: list[dict[str, Any]], images: list[tuple[int, str]]) -> Optional[str]:
    """The URL of a chat request's one image, which must be in its last user message (it goes
    before that message's text, as prompt.image_column's image does), or None; Refused otherwise."""
    if not images:
        return None
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if len(images) > 1 or [images[0][0]] != users[-1:]:
        where = ", ".join(f"body.messages[{i}]" for i, _ in images)
        raise Refused(
            f"image_url parts in {where}: one image per request, in the last user message, can run here "
            "(send several images as several requests)"
        )
    return images[0][1]


def body_sampling(body: dict[str, Any], url: str) -> dict[str, Any]:
    """A request's own sampling (vLLM names; response_format as structured_outputs); a field that
    would change the answer and cannot be honoured raises Refused naming it."""
    sampling = {SAMPLING_FIELDS[k]: v for k, v in body.items() if k in SAMPLING_FIELDS and v is not None}
    if isinstance(sampling.get("stop"), str):
        sampling["stop"] = [sampling["stop"]]
    structured = response_format(body.get("response_format"))
    if structured is not None:
        sampling["structured_outputs"] = structured
    for key, value in body.items():
        if key in SAMPLING_FIELDS or key in IGNORED_FIELDS or key in ("response_format", TEXT_FIELD[url]):
            continue
        if value in ASKS_NOTHING or (key in TOOL_FIELDS and value in ("none", "auto")):
            continue  # e.g. logprobs false, tools [], tool_choice "none": the answer is the same without it
        raise Refused(f"body.{key}: {refusal(key)}")
    if url == EMBEDDINGS_URL and body.get("encoding_format") not in (None, "float"):
        raise Refused('body.encoding_format: embeddings are written as floats; drop it or set it to "float"')
    return sampling


def refusal(key: str) -> str:
    """Why a body field cannot be honoured, and what to do."""
    if key in ("logprobs", "top_logprobs"):
        return "token logprobs are not written in the output (its logprobs are null); drop the field or set it false"
    if key in TOOL_FIELDS:
        return f"tool calling cannot run here ({TEXT_HINT}); drop the field"
    if key == "dimensions":
        return "a request cannot choose its own dimensions; drop the field and set task.dimensions for the run"
    return "not supported by batchinfer, and it could change the answer; drop the field from the request"


def response_format(value: Any) -> Optional[dict[str, Any]]:
    """body.response_format -> the row's structured_outputs (None: plain text); Refused when unusable."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json": {"type": "object"}}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise Refused("body.response_format.json_schema.schema must be a JSON schema object")
        return {"json": schema}
    raise Refused(
        f"body.response_format type {kind!r} is not supported: use text, json_object or json_schema"
        if kind
        else "body.response_format must be an object with a type (text, json_object or json_schema)"
    )


def task_mismatch(row: dict[str, Any], task: str) -> Optional[str]:
    """Why an OpenAI request cannot run in this task (an error row, not a failed run), or None."""
    url = row.get("url")
    if url is None:  # not an OpenAI batch input
        return None
    if row.get(REFUSED):
        return str(row[REFUSED])
    runs = "embed" if url == EMBEDDINGS_URL else "generate"
    if task != runs:
        return (
            f"a {url} request runs with task={runs}, and this run has task={task}: submit those lines as their own run"
        )
    if url == EMBEDDINGS_URL and row.get(RAW_PROMPT) is None:
        return "body.input must be one string (several inputs or token ids: one request line each)"
    return None


def convert_requests(files: list[Path], out: Path, open_text: Any) -> None:
    """Stream request files into one Parquet file of SCHEMA (10,000 rows at a time)."""
    with pq.ParquetWriter(out, SCHEMA) as writer:
        batch: list[dict[str, Any]] = []
        for path in files:
            with open_text(path) as f:
                for lineno, raw in enumerate(f, start=1):
                    line = raw.decode("utf-8").removeprefix("\ufeff")
                    if line.strip():
                        batch.append(request_row(json.loads(line), f"{path}:{lineno}"))
                    if len(batch) >= 10000:
                        writer.write_table(pa.Table.from_pylist(batch, schema=SCHEMA))
                        batch = []
        if batch:
            writer.write_table(pa.Table.from_pylist(batch, schema=SCHEMA))


def response_line(row: dict[str, Any], url: str, model: str, tag: str, created: Optional[int] = None) -> dict[str, Any]:
    """One output row -> an OpenAI Batch output line (id, custom_id, response, error)."""
    req = f"{tag}-{row['row']}"
    if row["error"]:
        return {
            "id": f"batch_req_{req}",
            "custom_id": row["id"],
            "response": None,
            "error": {"code": row["error"]["kind"], "message": row["error"]["message"]},
        }
    if url == EMBEDDINGS_URL:
        tokens = row["prompt_tokens"]
        return {
            "id": f"batch_req_{req}",
            "custom_id": row["id"],
            "response": {
                "status_code": 200,
                "request_id": req,
                "body": {
                    "object": "list",
                    "data": [{"object": "embedding", "index": 0, "embedding": list(row["embedding"])}],
                    "model": model,
                    "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                },
            },
            "error": None,
        }
    texts = row.get("samples") or [row["text"]]
    if url == CHAT_URL:
        obj = "chat.completion"
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": t},
                "logprobs": None,
                "finish_reason": row["finish_reason"],
            }
            for i, t in enumerate(texts)
        ]
    else:
        obj = "text_completion"
        choices = [
            {"index": i, "text": t, "logprobs": None, "finish_reason": row["finish_reason"]}
            for i, t in enumerate(texts)
        ]
    usage = {
        "prompt_tokens": row["prompt_tokens"],
        "completion_tokens": row["output_tokens"],
        "total_tokens": row["prompt_tokens"] + row["output_tokens"],
    }
    body = {
        "id": f"cmpl-{req}",
        "object": obj,
        "created": created or int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage,
    }
    return {
        "id": f"batch_req_{req}",
        "custom_id": row["id"],
        "response": {"status_code": 200, "request_id": req, "body": body},
        "error": None,
    }
