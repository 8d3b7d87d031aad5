"""vLLM's SamplingParams and StructuredOutputsParams arguments from the sampling config (plain
dicts: nothing of vllm is imported here; engine/vllm_engine.py builds the params from them)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional


def structured_kwargs(so: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """StructuredOutputsParams arguments; a json value naming a file is read from it (in a run's
    config, the copy frozen into DIR/files/ when the run was prepared)."""
    from batchinfer.config.fingerprint import json_schema_path

    kw = {k: v for k, v in (so or {}).items() if v is not None}
    if not any(kw.get(k) is not None for k in ("choice", "regex", "json", "grammar", "json_object")):
        return None
    path = json_schema_path(kw.get("json"))
    if path:
        kw["json"] = json.loads(Path(path).expanduser().read_text(encoding="utf-8"))
    return kw


def sampling_kwargs(sampling: dict[str, Any]) -> dict[str, Any]:
    """vllm.SamplingParams arguments from the sampling config (structured_outputs apart)."""
    kw = dict(sampling)
    kw.pop("structured_outputs", None)
    kw.pop("seed_per_row", None)  # already turned into each row's own seed
    if kw.get("top_k") == 0:
        kw["top_k"] = -1  # both mean "all tokens"; older vLLM accepts only -1
    for key in ("seed", "logprobs"):
        if kw.get(key) is None:
            kw.pop(key, None)
    return kw
