"""vLLM-CPU's LoRA ops on the installed vLLM (no engine): a token of LoRA index -1 (no adapter) gets
the last slot's delta from vLLM's own op, and none once engine/lora_ops.py has mended it; tokens of
a real index are computed bit for bit as before."""

from __future__ import annotations

from typing import Any

import pytest

from batchinfer.engine import lora_ops


@pytest.fixture
def vllm_ops(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any, Any]:
    """vLLM's torch-ops module, its package and punica_cpu, their ops restored after the test."""
    import vllm.lora.ops.torch_ops as package
    from vllm.lora.ops.torch_ops import lora_ops as ops
    from vllm.lora.punica_wrapper import punica_cpu

    for module in (ops, package, punica_cpu):
        for name in lora_ops.OPS:
            monkeypatch.setattr(module, name, getattr(module, name))
    return ops, package, punica_cpu


def mixed(seed: int) -> tuple[Any, ...]:
    """Five tokens over three adapter slots, two of them without an adapter (-1), non-zero weights."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 16, generator=g)
    a = torch.randn(3, 1, 4, 16, generator=g)  # shrink: slots x 1 x rank x in
    b = torch.randn(3, 1, 8, 4, generator=g)  # expand: slots x 1 x out x rank
    y = torch.randn(5, 8, generator=g)
    return x, a, b, y, torch.tensor([0, -1, 2, -1, 1])


def test_vllm_gives_a_token_without_adapter_the_last_slots_delta(vllm_ops: tuple[Any, Any, Any]) -> None:
    ops, _, _ = vllm_ops
    assert lora_ops.leaks(ops.bgmv_shrink)  # the fault mended below is in the installed vLLM
    x, _, b, y, idx = mixed(1)
    out = y.clone()
    ops.bgmv_expand(x[:, :4], b, out, idx, True)
    assert not out[1].equal(y[1]) and out[1].equal(y[1] + x[1, :4] @ b[2, 0].T)


def test_mended_ops_leave_base_tokens_alone_and_adapter_tokens_as_they_were(vllm_ops: tuple[Any, Any, Any]) -> None:
    import torch

    ops, package, punica_cpu = vllm_ops
    original = {name: getattr(ops, name) for name in lora_ops.OPS}
    x, a, b, y, idx = mixed(2)
    real = idx >= 0

    def runs(shrink: Any, expand: Any, expand_slice: Any) -> list[Any]:
        s = torch.zeros(5, 4)
        shrink(x, a, s, idx, 0.5)
        e, sl = y.clone(), y.clone()
        expand(s, b, e, idx, True)
        expand_slice(s, b[:, :, :4], sl, idx, 2, 4, True)
        return [s, e, sl]

    before = runs(*original.values())
    assert lora_ops.mend(ops, package, punica_cpu)
    assert not lora_ops.mend(ops, package, punica_cpu)  # once only
    assert not lora_ops.leaks(ops.bgmv_shrink)
    for module in (ops, package, punica_cpu):
        assert all(getattr(getattr(module, name), "skips_no_lora", False) for name in lora_ops.OPS), module
    after = runs(ops.bgmv_shrink, ops.bgmv_expand, ops.bgmv_expand_slice)
    for old, new, start in zip(before, after, (torch.zeros(5, 4), y, y), strict=True):
        assert new[real].equal(old[real])  # adapter tokens: bit for bit
        assert new[~real].equal(start[~real])  # base tokens: untouched
    # the prefill ops (sgmv_*) call the bgmv ops by name: mended too
    s = torch.zeros(5, 4)
    starts, lens = torch.tensor([0, 1, 2, 3, 4]), torch.ones(5, dtype=torch.long)
    ops.sgmv_shrink(x, a, s, starts, lens, idx, 5, 1, 5, 0.5)
    assert s[~real].abs().sum() == 0 and s[real].equal(after[0][real])
    # a batch of base tokens only is left as it was
    only = y.clone()
    ops.bgmv_expand(x[:, :4], b, only, torch.full((5,), -1), True)
    assert only.equal(y)
