"""Where a JSON input the readers refused goes wrong, by file:line: a key given twice in one object,
a number no 64-bit type holds (the readers say "row 0" of a block, or a character position)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional

from batchinfer.inputs.textfiles import text_lines

# A JSON string (skipped) or a number literal, to find out-of-range integers in a JSON document.
_STRING_OR_NUMBER = re.compile(r'"(?:[^"\\]|\\.)*"|-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?')
INT_RANGE = (-(1 << 63), 1 << 64)  # the integers ujson (`datasets`' reader of JSON documents) takes


class _Fault(ValueError):
    """What is wrong with one JSON value, said for the user."""


def jsonl_fault(files: list[Path]) -> Optional[str]:
    """`file:line: what; what to do` for the first JSON lines row with a key twice in one object or a
    number too big for a 64-bit float, or None. A pass over the files: only run once a reader failed."""
    for path in files:
        for lineno, line in text_lines(path):
            if not line.strip():
                continue
            try:
                json.loads(line, object_pairs_hook=_unique_keys, parse_float=_finite_float)
            except _Fault as e:
                return f"{path}:{lineno}: {e}"
            except (ValueError, RecursionError):
                continue  # not JSON: the line-by-line check says so
    return None


def json_document_fault(path: Path) -> Optional[str]:
    """`file:line:column: ...` for the first integer literal of a JSON document outside what its
    reader holds (ujson: -2**63 to 2**64 - 1), or None."""
    text = "".join(line for _, line in text_lines(path))
    for m in _STRING_OR_NUMBER.finditer(text):
        literal = m.group()
        if literal.startswith('"') or not literal.lstrip("-").isdigit():
            continue
        if not INT_RANGE[0] <= int(literal) < INT_RANGE[1]:
            line = text.count("\n", 0, m.start()) + 1
            column = m.start() - text.rfind("\n", 0, m.start())
            short = literal if len(literal) <= 40 else literal[:20] + "..."
            return (
                f"{path}:{line}:{column}: the integer {short} does not fit 64 bits; write it as a JSON string "
                f'("{short}") or a decimal'
            )
    return None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) < len(pairs):
        twice = next(k for i, (k, _) in enumerate(pairs) if k in (p[0] for p in pairs[:i]))
        raise _Fault(f"key {twice!r} appears twice in one object; remove or rename one")
    return obj


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        short = text if len(text) <= 40 else text[:20] + "..."
        raise _Fault(f'the number {short} is too big for a 64-bit float; write it as a JSON string ("{short}")')
    return value
