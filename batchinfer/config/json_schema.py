"""sampling.structured_outputs.json: a JSON schema written inline or in a file, read and checked
before a run starts (vLLM would refuse it at the first row, after the job waited in the queue)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from batchinfer.errors import ConfigError

KEY = "sampling.structured_outputs.json"
JSON_TYPES = frozenset({"string", "number", "integer", "boolean", "object", "array", "null"})
# Keywords whose values are data, not schemas: a "type" inside them is no keyword.
DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})


def json_schema_path(value: Any) -> Optional[str]:
    """The file a sampling.structured_outputs.json value names; None when inline JSON or unset."""
    if isinstance(value, str) and not value.lstrip().startswith("{"):
        return value
    return None


def schema_problem(schema: Any, where: str = "") -> Optional[str]:
    """Why a parsed JSON value is not a JSON schema (an object, or true/false; its `type`s JSON
    Schema's types), or None; where: the path of a nested schema, for the message."""
    if isinstance(schema, bool):
        return None
    what = f"{where} is" if where else "it is"
    if not isinstance(schema, dict):
        return f'{what} a {type(schema).__name__}, but a schema is an object such as {{"type": "object"}}'
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    unknown = [k for k in kinds if k not in JSON_TYPES]
    if unknown:
        return (
            f"{where + ' has' if where else 'it has'} type {unknown[0]!r}, not one of: {', '.join(sorted(JSON_TYPES))}"
        )
    at = f"{where}." if where else ""
    for key, value in schema.items():
        if key in DATA_KEYWORDS:
            continue
        if key in ("properties", "patternProperties", "$defs", "definitions") and isinstance(value, dict):
            subs = [(f"{at}{key}.{name}", sub) for name, sub in value.items()]
        elif isinstance(value, dict):
            subs = [(f"{at}{key}", value)]
        elif isinstance(value, list) and key in ("anyOf", "allOf", "oneOf", "prefixItems", "items"):
            subs = [(f"{at}{key}[{i}]", sub) for i, sub in enumerate(value)]
        else:
            continue
        for sub_where, sub in subs:
            problem = schema_problem(sub, sub_where) if isinstance(sub, (dict, bool)) else None
            if problem:
                return problem
    return None


def parse_json_schema(text: str | bytes, where: str) -> Any:
    """The schema in text; ConfigError naming where it comes from when it is not JSON or no schema."""
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise ConfigError(f'{where}: not valid JSON ({e}); write a JSON schema, e.g. {{"type": "object"}}') from None
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


def check_json_schema(value: Optional[str]) -> None:
    """sampling.structured_outputs.json, inline or the file it names, is a readable JSON schema."""
    if value is None:
        return
    path = json_schema_path(value)
    if path is None:
        parse_json_schema(value, f"{KEY} (inline)")
    else:
        parse_json_schema(read_json_schema(path), f"{KEY} {path}")
