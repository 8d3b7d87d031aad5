"""A JSON schema's structure as vLLM's grammar backends walk it: which keywords hold sub-schemas, a
schema's types, the sub-schemas below one (requests/schemas.py judges them)."""

from __future__ import annotations

from typing import Any

# Keywords whose values are data, not schemas: a "type" inside them is no keyword.
DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
SCHEMA_VALUES = (
    "additionalProperties",
    "items",
    "not",
    "contains",
    "propertyNames",
    "if",
    "then",
    "else",
    "additionalItems",
    "unevaluatedProperties",
    "unevaluatedItems",
)


def schema_types(schema: dict[str, Any]) -> list[Any]:
    """The schema's "type" as a list (empty: none given)."""
    kind = schema.get("type")
    return kind if isinstance(kind, list) else [kind] if kind is not None else []


def subschemas(schema: dict[str, Any], at: str) -> list[tuple[str, Any]]:
    """(path, sub-schema) of each schema below this one (their kinds were checked already)."""
    subs = []
    for key, value in schema.items():
        if key in DATA_KEYWORDS:
            continue
        if key in SCHEMA_MAPS:
            subs += [(f"{at}{key}.{name}", sub) for name, sub in value.items()]
        elif key in SCHEMA_LISTS or (key == "items" and isinstance(value, list)):
            subs += [(f"{at}{key}[{i}]", sub) for i, sub in enumerate(value)]
        elif key in SCHEMA_VALUES or isinstance(value, dict):
            subs.append((f"{at}{key}", value))
    return subs


def schema_nodes(schema: Any) -> list[tuple[str, dict[str, Any]]]:
    """(path, schema) of the schema and every schema below it, in order (its keywords checked already)."""
    out, stack = [], [("", schema)]
    while stack:
        at, s = stack.pop()
        if isinstance(s, dict):
            out.append((at, s))
            stack += reversed(subschemas(s, f"{at}." if at else ""))
    return out
