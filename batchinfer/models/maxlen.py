"""The context length vLLM derives from a model folder when model.max_model_len is unset."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from batchinfer.models.sizing import text_config

# vLLM's keys, smallest wins (ModelArchConfigConvertor.derive_max_model_len_and_key).
LENGTH_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
# RoPE types whose max_position_embeddings is already the scaled length.
PRESCALED_ROPE = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")
DEFAULT_LEN = 2048  # vLLM's fallback when config.json names no length


def _read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def rope_parameters(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """RoPE settings of config.json (rope_parameters, or the older rope_scaling), one per layer type."""
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    if not isinstance(rp, dict):
        return []
    if rp and all(isinstance(v, dict) for v in rp.values()):  # per layer type (full/sliding attention)
        return list(rp.values())
    return [rp]


def derived_max_model_len(folder: Path) -> tuple[int, str]:
    """(max_model_len, where it comes from) as vLLM's _get_and_verify_max_len derives it without
    model.max_model_len: smallest length key, the tokenizer's model_max_length, RoPE scaling factor."""
    cfg = _read(folder / "config.json")
    c = text_config(cfg)
    found = {k: c[k] for k in LENGTH_KEYS if isinstance(c.get(k), (int, float))}
    length: Optional[float] = min(found.values()) if found else None
    source = f"config.json {min(found, key=found.get)}" if found else ""
    if c.get("model_max_length"):  # Cohere: this key wins over the others
        length, source = c["model_max_length"], "config.json model_max_length"
    tok_len = _read(folder / "tokenizer_config.json").get("model_max_length")
    if isinstance(tok_len, (int, float)) and (length is None or tok_len < length):
        length, source = tok_len, "tokenizer_config.json model_max_length"
    if length is None:
        return DEFAULT_LEN, f"vLLM's default {DEFAULT_LEN} (config.json names no length)"
    rope = rope_parameters(c)
    if rope and "gemma3" not in str(cfg.get("model_type", "")):
        factor = 1.0
        for rp in rope:
            if (rp.get("rope_type") or rp.get("type") or "default") not in PRESCALED_ROPE:
                factor = rp.get("factor", factor) or 1.0
        if factor != 1.0:
            length, source = length * factor, f"{source} x RoPE factor {factor:g}"
        if any((rp.get("rope_type") or rp.get("type")) == "longrope" for rp in rope):
            original = cfg.get("original_max_position_embeddings")
            if original:
                return int(original), "config.json original_max_position_embeddings (longrope)"
    return int(length), source


def max_model_len(configured: Optional[int], folder: Path) -> tuple[int, str]:
    """model.max_model_len when set, else what vLLM derives; with where it comes from."""
    if configured:
        return configured, "model.max_model_len"
    return derived_max_model_len(folder)
