"""The context length vLLM derives from a model folder when model.max_model_len is unset."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from batchinfer.errors import ConfigError
from batchinfer.models.model_files import read_model_json
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
    return read_model_json(path) if path.is_file() else {}


def rope_parameters(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """RoPE settings of config.json (rope_parameters, or the older rope_scaling), one per layer type."""
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    if not isinstance(rp, dict):
        return []
    if rp and all(isinstance(v, dict) for v in rp.values()):  # per layer type (full/sliding attention)
        return list(rp.values())
    return [rp]


# Sentence-transformers configs whose max_seq_length vLLM takes as the model's length (encoder_config).
SENTENCE_CONFIGS = (
    "sentence_bert_config.json",
    "sentence_roberta_config.json",
    "sentence_distilbert_config.json",
    "sentence_camembert_config.json",
    "sentence_albert_config.json",
    "sentence_xlm-roberta_config.json",
    "sentence_xlnet_config.json",
)
ALLOW_LONG_ENV = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"


def model_limit(folder: Path) -> tuple[Optional[int], str]:
    """(the longest model.max_model_len vLLM accepts for the model, where it comes from), as its
    _get_and_verify_max_len derives it: smallest length key, tokenizer_config.json's model_max_length
    (vLLM reads it for pooling models with absolute positions; only encoders have those), RoPE
    scaling factor, a sentence-transformers max_seq_length. None when config.json names no length
    (vLLM then takes any model.max_model_len)."""
    cfg = _read(folder / "config.json")
    c = text_config(cfg)
    found = {k: c[k] for k in LENGTH_KEYS if isinstance(c.get(k), (int, float))}
    length: Optional[float] = min(found.values()) if found else None
    source = f"config.json {min(found, key=found.get)}" if found else ""
    if c.get("model_max_length"):  # Cohere: this key wins over the others
        length, source = c["model_max_length"], "config.json model_max_length"
    tok_len = _read(folder / "tokenizer_config.json").get("model_max_length")
    absolute = c.get("position_embedding_type") == "absolute"
    if absolute and isinstance(tok_len, (int, float)) and (length is None or tok_len < length):
        length, source = tok_len, "tokenizer_config.json model_max_length"
    if length is None:
        return None, "config.json names no length"
    rope = rope_parameters(c)
    if rope and "gemma3" not in str(cfg.get("model_type", "")):
        factor = 1.0
        for rp in rope:
            if (rp.get("rope_type") or rp.get("type") or "default") not in PRESCALED_ROPE:
                factor = rp.get("factor", factor) or 1.0
        if factor != 1.0:
            length, source = length * factor, f"{source} x RoPE factor {factor:g}"
    for name in SENTENCE_CONFIGS:
        encoder = _read(folder / name)
        if encoder:
            if "max_seq_length" in encoder:
                return int(encoder["max_seq_length"]), f"{name} max_seq_length"
            break
    return int(length), source


def derived_max_model_len(folder: Path) -> tuple[int, str]:
    """(max_model_len, where it comes from) as vLLM derives it without model.max_model_len: the
    model's limit (model_limit), vLLM's default without one, longrope's original length."""
    length, source = model_limit(folder)
    if length is None:
        return DEFAULT_LEN, f"vLLM's default {DEFAULT_LEN} (config.json names no length)"
    cfg = _read(folder / "config.json")
    if any((rp.get("rope_type") or rp.get("type")) == "longrope" for rp in rope_parameters(text_config(cfg))):
        original = cfg.get("original_max_position_embeddings")
        if original:
            return int(original), "config.json original_max_position_embeddings (longrope)"
    return length, source


def max_model_len(configured: Optional[int], folder: Path) -> tuple[int, str]:
    """model.max_model_len when set, else what vLLM derives; with where it comes from."""
    if configured:
        return configured, "model.max_model_len"
    return derived_max_model_len(folder)


def check_max_model_len(configured: Optional[int], folder: Path, allow_long: bool) -> None:
    """ConfigError when model.max_model_len is above the model's limit: vLLM refuses to start
    (unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1, allow_long) or, on a length key of its own, accepts it."""
    if configured is None or allow_long:
        return
    limit, source = model_limit(folder)
    if limit is None or configured <= limit:
        return
    own = text_config(_read(folder / "config.json")).get("model_max_length")
    if isinstance(own, (int, float)) and configured <= own:
        return
    raise ConfigError(
        f"model.max_model_len={configured:,} is above what model.path {folder} allows: {limit:,} ({source}), "
        f"and vLLM would refuse to start; set model.max_model_len={limit} or less (or unset it), or, if the "
        f"model is known to handle more, cluster.env.{ALLOW_LONG_ENV}=1"
    )
