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
# Body fields that are SamplingParams (OpenAI name -> vLLM name).
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
}
SCHEMA = pa.schema(
    [
        ("custom_id", pa.string()),
        ("url", pa.string()),
        ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        (RAW_PROMPT, pa.string()),
        (ROW_SAMPLING, pa.string()),
    ]
)


def looks_like_openai_batch(first_line: str) -> bool:
    """Whether a JSONL line is an OpenAI Batch request."""
    try:
        obj = json.loads(first_line)
    except ValueError:
        return False
    return isinstance(obj, dict) and {"custom_id", "body"} <= set(obj)


def request_row(obj: Any, where: str) -> dict[str, Any]:
    """One request line -> a row of SCHEMA; a malformed request is an error naming its line."""
    if not isinstance(obj, dict) or not isinstance(obj.get("custom_id"), str) or not isinstance(obj.get("body"), dict):
        raise InputError(f"{where}: an OpenAI batch request needs a string custom_id and a body object")
    body = obj["body"]
    url = obj.get("url") or (CHAT_URL if "messages" in body else COMPLETIONS_URL)
    if url not in (CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL):
        raise InputError(
            f"{where}: url {url!r} is not supported (only {CHAT_URL}, {COMPLETIONS_URL} and {EMBEDDINGS_URL})"
        )
    messages = None
    prompt = None
    if url == EMBEDDINGS_URL:
        text = body.get("input")
        if isinstance(text, list) and len(text) == 1:
            text = text[0]
        # Not one string (several inputs, token ids): the row becomes an error row, the run goes on.
        prompt = text if isinstance(text, str) else None
    elif url == CHAT_URL:
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages
        ):
            raise InputError(f"{where}: body.messages must be a list of {{role, content}} with string content")
        messages = [{"role": m.get("role"), "content": m["content"]} for m in messages]
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise InputError(f"{where}: body.prompt must be a string for {COMPLETIONS_URL}")
    sampling = {SAMPLING_FIELDS[k]: v for k, v in body.items() if k in SAMPLING_FIELDS and v is not None}
    if isinstance(sampling.get("stop"), str):
        sampling["stop"] = [sampling["stop"]]
    return {
        "custom_id": obj["custom_id"],
        "url": url,
        "messages": messages,
        RAW_PROMPT: prompt,
        ROW_SAMPLING: json.dumps(sampling, sort_keys=True) if sampling else None,
    }


def task_mismatch(row: dict[str, Any], task: str) -> Optional[str]:
    """Why an OpenAI request cannot run in this task (an error row, not a failed run), or None."""
    url = row.get("url")
    if url is None:  # not an OpenAI batch input
        return None
    if (url == EMBEDDINGS_URL) != (task == "embed"):
        runs = "task=embed" if url == EMBEDDINGS_URL else "task=generate"
        return f"a {url} request runs with {runs}, and this run has task={task}: submit those lines as their own run"
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
