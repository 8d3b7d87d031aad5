"""Layout advice for one GPU type: whether the configured tensor parallel size leaves room for
enough sequences, the smallest one that does, and the levers when few fit (sizing.py's arithmetic)."""

from __future__ import annotations

from typing import Optional, TypedDict

from batchinfer.models.sizing import (
    GB,
    MIN_SEQS,
    THROUGHPUT_NOTE,
    TP_SIZES,
    WARN_SEQS,
    Fit,
    ModelSize,
    fit,
    seqs,
    smallest_fit,
    valid_tp,
)


class Advice(TypedDict):
    """The layout advice for one GPU type (advice)."""

    fit: Fit  # the configured tensor parallel size's
    recommended_tp: Optional[int]  # the smallest that fits; None: none up to TP_SIZES[-1]
    layout: str
    warnings: list[str]


def advice(model: ModelSize, wbytes: int, kv_bytes: int, gpu: str, util: float, tp: int, max_len: int) -> Advice:
    """Layout advice and warnings for the configured tensor parallel size on one GPU type."""
    now = fit(model, wbytes, kv_bytes, gpu, util, tp, max_len)
    best = smallest_fit(model, wbytes, kv_bytes, gpu, util, max_len)
    # An encoder-only model has no KV cache: what the memory after the weights holds is one batch's activations.
    room = "activations" if model.encoder_only else "a KV cache"
    warnings = []
    if now.kv_free == 0:
        warnings.append(
            f"the weights ({now.weights / GB:.1f} GB per GPU at tensor_parallel_size={tp}) leave no room for "
            f"{room} in {now.usable / GB:.1f} GB ({gpu} x gpu_memory_utilization {util})"
        )
    elif now.max_seqs < WARN_SEQS:
        levers = [f"a lower model.max_model_len (now {max_len:,})"]
        if kv_bytes > 1 and not model.encoder_only:
            levers.append("an FP8 KV cache (quantization=kv-fp8, or quantization.kv_cache_dtype=fp8)")
        if 2 * tp <= TP_SIZES[-1] and valid_tp(model, 2 * tp):
            levers.append(
                f"tensor parallel {2 * tp} (model.tensor_parallel_size={2 * tp} cluster.gpus_per_task={2 * tp})"
            )
        what = "a batch's activations fit" if model.encoder_only else "the KV cache holds"
        warnings.append(
            f"{what} only {seqs(now.max_seqs)} sequences of max_model_len={max_len:,} at once: few "
            f"sequences in flight, low throughput. Levers: {', '.join(levers)}"
        )
    holds = "activations of" if model.encoder_only else "room for"
    if best is None:
        text = (
            f"no tensor parallel size up to {TP_SIZES[-1]} holds the weights plus {MIN_SEQS} sequences of "
            f"max_model_len={max_len:,} on {gpu}: quantize (quantization=fp8), lower model.max_model_len, or use a larger GPU"
        )
    elif best.tp == 1:
        text = (
            f"fits one GPU with {holds} {seqs(best.max_seqs)} sequences of {max_len:,} tokens: run one model copy per "
            f"GPU (model.tensor_parallel_size=1, cluster.gpus_per_task=1, more array tasks) rather than tensor "
            f"parallelism ({THROUGHPUT_NOTE})"
        )
    else:
        text = (
            f"needs tensor parallelism: model.tensor_parallel_size={best.tp} cluster.gpus_per_task={best.tp} is the "
            f"smallest of {', '.join(map(str, TP_SIZES))} that holds the weights plus {MIN_SEQS}+ sequences of "
            f"{max_len:,} tokens ({seqs(best.max_seqs)})"
        )
    if best is not None and best.tp != tp:
        text += f"; configured: tensor_parallel_size={tp}"
    return Advice(fit=now, recommended_tp=best.tp if best else None, layout=text, warnings=warnings)
