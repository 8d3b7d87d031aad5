"""LoRA adapters on the real engine (one shared LoRA engine, conftest.lora_engine): a run under an
adapter answers as vLLM's own LLM.chat with that LoRARequest does, and a per-row run's base-model
rows answer as a run without adapters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import lora_overrides
from support.corpus import read_output, write_corpus, write_rows
from support.runs import run_overrides

from batchinfer.config.compose import compose
from batchinfer.launch.local import run_local

pytestmark = pytest.mark.engine


def vllm_chat(engine: Any, texts: list[str], adapter: str, max_tokens: int) -> list[str]:
    """vLLM's own answers: LLM.chat, greedy, under the named adapter (the engine's LoRARequest)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    lora = engine._lora[adapter]
    outs = engine.llm.chat([[{"role": "user", "content": t}] for t in texts], params, lora_request=lora, use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def test_one_adapter_run_equals_vllm_own_chat(
    tmp_path: Path, tiny_model_path: Path, tiny_adapters: dict[str, Path], lora_engine: Any
) -> None:
    corpus = tmp_path / "c.jsonl"
    rows = write_corpus(corpus, 24, seed=46)
    ov = run_overrides(
        tiny_model_path, corpus, tmp_path / "run", *lora_overrides(tiny_adapters), "model.lora.default=a2"
    )
    out = read_output(run_local(compose(ov), engine=lora_engine).path)
    assert [r["id"] for r in out] == [r["id"] for r in rows]
    assert all(r["error"] is None and r["adapter"] == "a2" for r in out)
    expected = vllm_chat(lora_engine, [r["text"] for r in rows], "a2", 6)
    assert [r["text"] for r in out] == expected
    base = vllm_chat_base(lora_engine, [r["text"] for r in rows], 6)
    assert sum(a != b for a, b in zip(expected, base, strict=True)) >= len(rows) // 2, (
        "the adapter must change the answers"
    )


def vllm_chat_base(engine: Any, texts: list[str], max_tokens: int) -> list[str]:
    """vLLM's own greedy answers of the base model (no LoRARequest)."""
    from vllm import SamplingParams

    outs = engine.llm.chat(
        [[{"role": "user", "content": t}] for t in texts],
        SamplingParams(temperature=0, max_tokens=max_tokens),
        use_tqdm=False,
    )
    return [o.outputs[0].text for o in outs]


def test_per_row_adapters_each_row_answers_as_vllm_under_its_adapter(
    tmp_path: Path, tiny_model_path: Path, tiny_adapters: dict[str, Path], lora_engine: Any
) -> None:
    rows = write_corpus(tmp_path / "words.jsonl", 30, seed=47)
    names = ["a1", "a3", "a2", "a1", "a2"]
    rows = [dict(r, task=names[i % len(names)]) for i, r in enumerate(rows)]
    corpus = write_rows(tmp_path / "c.jsonl", rows)
    ov = run_overrides(
        tiny_model_path, corpus, tmp_path / "mixed", *lora_overrides(tiny_adapters), "input.adapter_column=task"
    )
    mixed = read_output(run_local(compose(ov), engine=lora_engine).path)
    assert [r["adapter"] for r in mixed] == [r["task"] for r in rows]
    texts = [r["text"] for r in rows]
    for name in ("a1", "a2", "a3"):
        mine = [i for i, r in enumerate(rows) if r["task"] == name]
        assert [mixed[i]["text"] for i in mine] == vllm_chat(lora_engine, [texts[i] for i in mine], name, 6), name
