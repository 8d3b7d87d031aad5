"""What vLLM's structured outputs refuse in a JSON schema, known without vllm.

vLLM compiles a schema with its backend: `xgrammar` alone when model.compact_json is on
(batchinfer's default), else `auto` (xgrammar, then guidance where xgrammar refuses). Refused under
both: nesting past 64 levels, a keyword of the wrong kind (`required` not a list of names,
`properties` not an object, a sub-schema that is no object, a length that is no integer, an empty
`enum`), a `$ref` to nothing in the schema, bounds no value meets (minLength > maxLength, minimum >
maximum, ...), a string `format` neither knows, `uniqueItems`, an invalid `pattern`. Refused under
xgrammar alone: the features vLLM's has_xgrammar_unsupported_json_features names (multipleOf, a
pattern or format with a length, allOf of two or more, ...). Where guidance compiles the schema
(auto's fallback for those, or named as the backend): what requests/guidance.py says it refuses.
tests/contract/test_request_verdict.py holds these rules against vLLM."""

from __future__ import annotations

import math
from typing import Any, Optional

from batchinfer.requests.guidance import GUIDANCE, guidance_problem
from batchinfer.requests.regexes import XGRAMMAR, regex_problem
from batchinfer.requests.schema_walk import (
    SCHEMA_LISTS,
    SCHEMA_MAPS,
    SCHEMA_VALUES,
    schema_nodes,
    schema_types,
    subschemas,
)

JSON_TYPES = frozenset({"string", "number", "integer", "boolean", "object", "array", "null"})
MAX_NESTING = 64  # vLLM's MAX_STRUCTURED_OUTPUT_JSON_NESTING: objects and arrays in the schema
# vLLM's STRING_SUPPORTED_FORMATS (xgrammar's); guidance knows no format xgrammar lacks that a run could use.
STRING_FORMATS = frozenset(
    {
        "email",
        "date",
        "time",
        "date-time",
        "duration",
        "ipv4",
        "ipv6",
        "hostname",
        "uuid",
        "uri",
        "uri-reference",
        "uri-template",
        "json-pointer",
        "relative-json-pointer",
    }
)
COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
# kind -> (low, high) keywords that bound the same count
COUNT_PAIRS = {
    "string": ("minLength", "maxLength"),
    "array": ("minItems", "maxItems"),
    "object": ("minProperties", "maxProperties"),
}


def schema_problem(schema: Any, backend: str = "auto") -> Optional[str]:
    """Why vLLM refuses a parsed JSON value as a JSON schema under backend, or None. The default,
    auto, refuses least: what is refused under it is refused under every backend."""
    if _too_deep(schema):
        return f"it nests objects and arrays more than {MAX_NESTING} levels deep (vLLM's limit); flatten it"
    problem = _problem(schema, "", schema, backend)
    if problem is None:  # a schema of valid keywords: what guidance refuses where it compiles it
        why = _guidance_judges(schema, backend)
        problem = guidance_problem(schema, why) if why else None
    return problem


def _guidance_judges(schema: Any, backend: str) -> Optional[str]:
    """Why guidance compiles the schema (named as the backend, or auto's fallback where xgrammar
    refuses a feature anywhere in it, as vLLM's has_xgrammar_unsupported_json_features walks it), or None."""
    if backend == GUIDANCE:
        return "model.engine_kwargs.structured_outputs_config names it"
    if backend != "auto":
        return None
    found = (_xgrammar_unsupported(s, schema_types(s)) for _, s in schema_nodes(schema))
    why = next((w for w in found if w), None)
    return f"vLLM's auto backend falls back to it: xgrammar does not support {why}" if why else None


def _too_deep(spec: Any) -> bool:
    """vLLM's _exceeds_json_nesting: level by level, without recursion."""
    level = [spec]
    for _ in range(MAX_NESTING):
        level = [
            child
            for node in level
            if isinstance(node, (dict, list))
            for child in (node.values() if isinstance(node, dict) else node)
            if isinstance(child, (dict, list))
        ]
        if not level:
            return False
    return True


def _problem(schema: Any, where: str, root: Any, backend: str) -> Optional[str]:
    if isinstance(schema, bool):
        return None
    if not isinstance(schema, dict):
        what = f"{where} is" if where else "it is"
        return f'{what} a {type(schema).__name__}, but a schema is an object such as {{"type": "object"}}'
    kinds = schema_types(schema)
    unknown = [k for k in kinds if k not in JSON_TYPES]
    if unknown:
        return (
            f"{where + ' has' if where else 'it has'} type {unknown[0]!r}, not one of: {', '.join(sorted(JSON_TYPES))}"
        )
    own = _keyword_problem(schema, kinds, root, backend) or _bounds_problem(schema, kinds, backend)
    if not own and backend == XGRAMMAR:
        own = _xgrammar_problem(schema, kinds)
    if own:
        return f"{where or 'the schema'} {own}"
    for sub_where, sub in subschemas(schema, f"{where}." if where else ""):
        problem = _problem(sub, sub_where, root, backend)
        if problem:
            return problem
    return None


def _keyword_problem(s: dict[str, Any], kinds: list[Any], root: Any, backend: str) -> Optional[str]:
    """A keyword whose value is not of the kind vLLM's backends take."""
    required = s.get("required")
    if required is not None and not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
        return f'has "required": {required!r}; it takes a list of property names, e.g. ["name"]'
    for key in SCHEMA_MAPS:
        if key in s and not isinstance(s[key], dict):
            return f'has "{key}": {s[key]!r}; it takes an object of sub-schemas by name'
    for key in SCHEMA_LISTS:
        if key in s and not isinstance(s[key], list):
            return f'has "{key}": {s[key]!r}; it takes a list of schemas'
    for key in SCHEMA_VALUES:
        ok = isinstance(s.get(key), (dict, bool)) or (key == "items" and isinstance(s.get(key), list))
        if key in s and not ok:
            return f'has "{key}": {s[key]!r}; it takes a schema (an object, or true/false)'
    for key in COUNTS:
        if key in s and (isinstance(s[key], bool) or not isinstance(s[key], int)):
            return f'has "{key}": {s[key]!r}; it takes an integer'
    if "enum" in s and not (isinstance(s["enum"], list) and s["enum"]):
        return f'has "enum": {s["enum"]!r}; it takes a non-empty list of values'
    ref = s.get("$ref")
    if ref is not None:
        return _ref_problem(ref, root, backend)
    if "format" in s and "string" in kinds and s["format"] not in STRING_FORMATS:
        return f'has "format": {s["format"]!r}, which vLLM does not know; it takes one of {", ".join(sorted(STRING_FORMATS))}'
    numbers = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
    for key in numbers if {"integer", "number"} & set(kinds) else ():
        if key in s and (isinstance(s[key], bool) or not isinstance(s[key], (int, float))):
            return f'has "{key}": {s[key]!r}; it takes a number'
    if "integer" in kinds and any(abs(s.get(k, 0)) >= 2**63 for k in numbers[:4]):
        return "has a bound beyond 64-bit integers, which vLLM's grammar backends cannot write as a range"
    unsupported = [k for k in ("uniqueItems", "contains", "minContains", "maxContains") if k in s]
    if unsupported and "array" in kinds:
        return f'has "{unsupported[0]}", which vLLM\'s grammar backends do not support; drop it'
    return _pattern_problem(s, backend)


def _pattern_problem(s: dict[str, Any], backend: str) -> Optional[str]:
    patterns = [("pattern", s["pattern"])] if "pattern" in s else []
    patterns += [(f"patternProperties key {k!r}", k) for k in s.get("patternProperties") or {}]
    for what, pattern in patterns:
        if not isinstance(pattern, str):
            return f'has "{what}": {pattern!r}; it takes a regex (a string)'
        why = regex_problem(pattern, backend, in_json=True)
        if why:
            return f"has {what} {pattern!r}: vLLM takes {why}"
    return None


def _ref_problem(ref: Any, root: Any, backend: str) -> Optional[str]:
    if not isinstance(ref, str):
        return f'has "$ref": {ref!r}; it takes a string such as "#/$defs/name"'
    if not ref.startswith("#/"):
        return None  # "#", an anchor or another document: vLLM's default backend takes them
    if "~" in ref and backend == XGRAMMAR:
        return (
            f'has "$ref": {ref!r}: vLLM\'s xgrammar backend does not resolve ~0/~1 in a pointer; rename the definition'
        )
    node = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return f'has "$ref": {ref!r}, which points to nothing in the schema; define it (e.g. under "$defs") or fix the path'
    return None


def _bounds_problem(s: dict[str, Any], kinds: list[Any], backend: str) -> Optional[str]:
    """Bounds no value meets. xgrammar judges them for each of several types; guidance (auto's
    fallback) only for a schema of that one type."""

    def judged(kind: str) -> bool:
        return kind in kinds and (backend == XGRAMMAR or kinds == [kind])

    for kind, (low, high) in COUNT_PAIRS.items():
        lo, hi = s.get(low), s.get(high)
        if judged(kind) and isinstance(lo, int) and isinstance(hi, int) and lo > hi:
            return f"has {low} {lo} above {high} {hi}: no value meets both"
    if not (judged("integer") or judged("number")):
        return None
    bounds = {k: s.get(k) for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")}
    bounds = {k: v for k, v in bounds.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if "integer" in kinds:
        lows = [math.ceil(bounds["minimum"])] if "minimum" in bounds else []
        lows += [math.floor(bounds["exclusiveMinimum"]) + 1] if "exclusiveMinimum" in bounds else []
        highs = [math.floor(bounds["maximum"])] if "maximum" in bounds else []
        highs += [math.ceil(bounds["exclusiveMaximum"]) - 1] if "exclusiveMaximum" in bounds else []
        if lows and highs and max(lows) > min(highs):
            return f"has bounds {bounds} that no integer meets"
        return None
    lo_in, lo_ex, hi_in, hi_ex = (bounds.get(k) for k in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"))
    empty = (
        (lo_in is not None and hi_in is not None and lo_in > hi_in)
        or (lo_ex is not None and hi_ex is not None and lo_ex >= hi_ex)
        or (lo_in is not None and hi_ex is not None and lo_in >= hi_ex)
        or (lo_ex is not None and hi_in is not None and lo_ex >= hi_in)
    )
    return f"has bounds {bounds} that no number meets" if empty else None


def _xgrammar_problem(s: dict[str, Any], kinds: list[Any]) -> Optional[str]:
    """Why vLLM's xgrammar backend refuses one schema (its sub-schemas are walked), or None."""
    why = _xgrammar_unsupported(s, kinds)
    if why is None:
        return None
    return (
        f"uses {why}, which vLLM's xgrammar backend does not support (model.compact_json=true); set "
        "model.compact_json=false (vLLM then falls back to guidance) or simplify the schema"
    )


def _xgrammar_unsupported(s: dict[str, Any], kinds: list[Any]) -> Optional[str]:
    """vLLM's has_xgrammar_unsupported_json_features, for one schema: the feature, or None."""
    pattern_props = s.get("patternProperties")
    rules = [
        ({"integer", "number"} & set(kinds) and "multipleOf" in s, "multipleOf"),
        ("integer" in kinds and _fractional_bound(s), "an integer with a bound that is not a whole number"),
        (isinstance(s.get("items"), list), "items as a list of schemas (write prefixItems)"),
        (
            "string" in kinds and _length_with_pattern(s),
            "a pattern or format together with minLength or maxLength",
        ),
        (
            "object" in kinds and "propertyNames" in s and _property_names_unsupported(s),
            "propertyNames together with properties, patternProperties, unevaluatedProperties or a length",
        ),
        (
            "object" in kinds and isinstance(pattern_props, dict) and ("properties" in s or len(pattern_props) > 1),
            "patternProperties together with properties, or more than one patternProperties",
        ),
        (isinstance(s.get("allOf"), list) and len(s["allOf"]) >= 2, "allOf with two or more schemas"),
    ]
    return next((what for hit, what in rules if hit), None)


def _property_names_unsupported(s: dict[str, Any]) -> bool:
    names = s["propertyNames"]
    length = isinstance(names, dict) and _length_with_pattern(names)
    return bool(
        length or "patternProperties" in s or "properties" in s or s.get("unevaluatedProperties", True) is not True
    )


def _length_with_pattern(s: dict[str, Any]) -> bool:
    return ("pattern" in s or "format" in s) and ("minLength" in s or "maxLength" in s)


def _fractional_bound(s: dict[str, Any]) -> bool:
    bounds = (s.get(k) for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"))
    return any(isinstance(b, float) and not b.is_integer() for b in bounds)
