"""sampling.structured_outputs.json: a JSON schema written inline or in a file, read and checked
before a run starts (vLLM would refuse it at the first row, after the job waited in the queue)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from batchinfer.errors import ConfigError

KEY = "sampling.structured_outputs.json"


def json_schema_path(value: Any) -> Optional[str]:
    """The file a sampling.structured_outputs.json value names; None when inline JSON or unset."""
    if isinstance(value, str) and not value.lstrip().startswith("{"):
        return value
    return None


def parse_json_schema(text: str | bytes, where: str) -> Any:
    """The schema in text; ConfigError naming where it comes from when it is not JSON or no schema."""
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise ConfigError(f'{where}: not valid JSON ({e}); write a JSON schema, e.g. {{"type": "object"}}') from None
    from batchinfer.requests.schemas import schema_problem

    problem = schema_problem(schema)
    if problem:
        raise ConfigError(f"{where}: not a JSON schema: {problem}")
    return schema


def read_json_schema(path: str) -> bytes:
    """The bytes of a schema file; ConfigError naming the key and path when it cannot be read."""
    p = Path(path).expanduser()
    try:
        return p.read_bytes()
    except OSError as e:
        raise ConfigError(f"{KEY} {path}: cannot read it ({e.strerror or e}; resolved to {p.absolute()})") from None


def load_json_schema(value: str) -> Any:
    """The schema sampling.structured_outputs.json names, inline or in a file; ConfigError naming
    the key (and file) when it cannot be read or is no JSON schema."""
    path = json_schema_path(value)
    if path is None:
        return parse_json_schema(value, f"{KEY} (inline)")
    return parse_json_schema(read_json_schema(path), f"{KEY} {path}")
