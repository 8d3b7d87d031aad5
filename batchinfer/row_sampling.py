"""A row's own SamplingParams overrides: shared by the worker and `batchinfer validate`."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from batchinfer.openai_batch import ROW_SAMPLING
from batchinfer.prompts import RowError


def row_sampling(cfg: dict[str, Any], row: dict[str, Any], id_: Any) -> str:
    """A row's own sampling overrides as canonical JSON ("" when none): an OpenAI request's
    fields, input.sampling_column, and the row's seed under sampling.seed_per_row."""
    own: dict[str, Any] = json.loads(row.get(ROW_SAMPLING) or "{}")
    column = cfg["input"]["sampling_column"]
    if column and row.get(column) is not None:
        value = row[column]
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise RowError("sampling", f"field {column!r} is not a JSON object: {e}") from None
        if not isinstance(value, dict):
            raise RowError("sampling", f"field {column!r} must be an object of SamplingParams, got {value!r}")
        unknown = sorted(set(value) - set(cfg["sampling"]) - {"structured_outputs"})
        if unknown:
            raise RowError("sampling", f"field {column!r} has unknown sampling keys {unknown}")
        own.update({k: v for k, v in value.items() if v is not None})
    s = cfg["sampling"]
    if s["seed_per_row"] and "seed" not in own:
        own["seed"] = row_seed(s["seed"], id_)
    return json.dumps(own, sort_keys=True) if own else ""


def row_seed(seed: int, id_: Any) -> int:
    """A row's own seed: stable across runs, shards and resumes; 31 bits, as every backend takes."""
    digest = hashlib.blake2b(f"{seed}:{id_!r}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & 0x7FFFFFFF
