"""LoRA adapters of a run (model.lora): their folders, ranks, engine ids and identities, read without
vllm or torch (login node). The engine (engine/vllm_engine.py) makes vLLM's LoRARequest from these."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from batchinfer.errors import ConfigError
from batchinfer.models.identity import SAMPLED, ModelIdentity, model_identity

ADAPTER_CONFIG = "adapter_config.json"  # PEFT's: r is the adapter's rank
# vLLM's worker with its CPU LoRA ops mended (engine/lora_ops.py); an engine over several nodes
# takes config/nodes.py's RANK_WORKER, which is one too.
LORA_WORKER = "batchinfer.engine.vllm_engine.LoraWorker"


def adapter_folder(path: str, name: str = "") -> Path:
    """A PEFT adapter's folder: a local folder (~ expanded), or a hub name (org/adapter) as model.path
    takes one, its snapshot in the local Hugging Face cache (never fetched; ConfigError naming
    model.lora.adapters.NAME and the download command when it is not there)."""
    from batchinfer.models.locations import hub_snapshot, looks_local

    if looks_local(path):
        return Path(path).expanduser()
    return hub_snapshot(path, None, f"model.lora.adapters.{name or path}")


def pinned_adapters(adapters: dict[str, str]) -> dict[str, str]:
    """model.lora.adapters with each hub name pinned to its snapshot folder in the local cache, as
    prepare pins model.path's revision: a later download of a newer revision leaves the run as it was."""
    from batchinfer.models.locations import looks_local

    return {n: p if looks_local(p) else str(adapter_folder(p, n)) for n, p in adapters.items()}


def adapter_rank(name: str, path: str) -> int:
    """The rank (`r`) in an adapter's adapter_config.json; ConfigError naming the file otherwise."""
    file = adapter_folder(path, name) / ADAPTER_CONFIG
    try:
        r = json.loads(file.read_text(encoding="utf-8")).get("r")
    except (OSError, ValueError, AttributeError) as e:
        raise ConfigError(
            f"model.lora.adapters.{name}: cannot read {file} ({e}); point it at a PEFT adapter folder"
        ) from None
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ConfigError(f"model.lora.adapters.{name}: {file} has r={r!r}; a LoRA adapter's rank is an integer >= 1")
    return r


def adapter_ids(adapters: dict[str, str]) -> dict[str, int]:
    """Each adapter's engine id (vLLM's lora_int_id, >= 1): stable, by sorted name."""
    return {name: i for i, name in enumerate(sorted(adapters), start=1)}


def lora_engine_kwargs(lora: Any) -> dict[str, Any]:
    """vllm.LLM's LoRA arguments (none without adapters): max_loras and max_lora_rank unless set
    come from the adapters (all of them at once; the largest r); the worker that gives base-model
    tokens no adapter's delta."""
    if not lora.adapters:
        return {}
    ranks = [adapter_rank(n, p) for n, p in sorted(lora.adapters.items())]
    return {
        "enable_lora": True,
        "max_loras": lora.max_loras or len(lora.adapters),
        "max_lora_rank": lora.max_lora_rank or lora_rank_slot(max(ranks)),
        "worker_cls": LORA_WORKER,
    }


def lora_rank_slot(rank: int) -> int:
    """The smallest rank vLLM's max_lora_rank takes (vllm_names.LORA_RANKS) that holds an adapter of rank."""
    from batchinfer.config.vllm_names import LORA_RANKS

    return next((r for r in LORA_RANKS if r >= rank), rank)


def check_lora(lora: Any, adapter_column: Optional[str]) -> None:
    """ConfigError before DIR is made: a default or adapter_column without adapters, an unknown
    default (naming the known ones), an adapter folder without a readable rank, a max_lora_rank
    vLLM does not take or below an adapter's rank."""
    from batchinfer.config.vllm_names import LORA_RANKS

    known = sorted(lora.adapters)
    if lora.default is not None and lora.default not in lora.adapters:
        raise ConfigError(
            f"model.lora.default={lora.default!r} is not an adapter of model.lora.adapters "
            f"(known: {', '.join(known) or 'none'}); add it there or name a known one"
        )
    if adapter_column and not known:
        raise ConfigError(f"input.adapter_column={adapter_column!r} needs model.lora.adapters (name: folder)")
    for key in ("max_loras", "max_lora_rank"):
        value = getattr(lora, key)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ConfigError(f"model.lora.{key}={value!r} is out of range: it takes an integer >= 1")
    if lora.max_lora_rank is not None and lora.max_lora_rank not in LORA_RANKS:
        near = next((r for r in LORA_RANKS if r >= lora.max_lora_rank), LORA_RANKS[-1])
        raise ConfigError(
            f"model.lora.max_lora_rank={lora.max_lora_rank}: vLLM takes one of {', '.join(map(str, LORA_RANKS))} "
            f"and would fail at the engine's start; set model.lora.max_lora_rank={near}, or unset it (the "
            "adapters' largest rank, rounded up to one of those)"
        )
    for name, path in sorted(lora.adapters.items()):
        rank = adapter_rank(name, path)
        if rank > LORA_RANKS[-1]:
            raise ConfigError(
                f"model.lora.adapters.{name}: its rank r={rank} is above {LORA_RANKS[-1]}, the largest vLLM loads"
            )
        if lora.max_lora_rank is not None and rank > lora.max_lora_rank:
            raise ConfigError(
                f"model.lora.adapters.{name} has rank r={rank}, above model.lora.max_lora_rank={lora.max_lora_rank}: "
                f"vLLM would refuse to load it; set model.lora.max_lora_rank={lora_rank_slot(rank)}, or unset it"
            )


def adapter_identities(adapters: dict[str, str], mode: str = SAMPLED) -> dict[str, ModelIdentity]:
    """Each adapter folder's identity (models/identity.py, its large files hashed as mode says), by name."""
    return {name: model_identity(adapter_folder(path, name), mode) for name, path in sorted(adapters.items())}


def lora_elements_per_slot(layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int) -> int:
    """Elements of one adapter slot of rank 1 in vLLM's stacked LoRA weights of a dense decoder:
    every layer's qkv, o, gate_up and down projections get an A (rank x in) and a B (out x rank)
    per slice, whatever modules an adapter targets (vLLM allocates them all at start)."""
    q, kv = heads * head_dim, kv_heads * head_dim
    a = 3 * hidden + q + 2 * hidden + inter  # qkv (3 slices), o, gate_up (2 slices), down: in features
    b = (q + 2 * kv) + hidden + 2 * inter + hidden  # their out features
    return layers * (a + b)


def lora_bytes(lora: Any, shape: tuple[int, int, int, int, int, int], elem_bytes: int) -> int:
    """Bytes vLLM holds for LoRA slots: max_loras x max_lora_rank x lora_elements_per_slot(shape) in
    the model's dtype; 0 without adapters. shape: layers, hidden, heads, kv_heads, head_dim, intermediate."""
    kw = lora_engine_kwargs(lora)
    if not kw:
        return 0
    return kw["max_loras"] * kw["max_lora_rank"] * lora_elements_per_slot(*shape) * elem_bytes
