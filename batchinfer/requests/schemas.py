"""What vLLM's structured outputs refuse in a JSON schema, known without vllm."""

from __future__ import annotations

from typing import Any, Optional

JSON_TYPES = frozenset({"string", "number", "integer", "boolean", "object", "array", "null"})
# Keywords whose values are data, not schemas: a "type" inside them is no keyword.
DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})


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
