"""LoRA adapters on the real engine (one shared LoRA engine, conftest.lora_engine): a run under an
adapter answers as vLLM's own LLM.chat with that LoRARequest does; in a per-row run of three
adapters and the base model interleaved each row answers as its adapter's own run, the base-model
rows as a run without adapters, and the engine loads each adapter about once a window."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import lora_overrides
from support.corpus import read_output, write_corpus, write_rows
from support.runs import run_overrides

from batchinfer.config.compose import compose
from batchinfer.launch.local import run_local
from batchinfer.rundir.progress import read_progress

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


def test_three_adapters_and_the_base_model_interleaved_answer_as_their_own_runs(
    tmp_path: Path, tiny_model_path: Path, tiny_adapters: dict[str, Path], lora_engine: Any, engine: Any
) -> None:
    rows = write_corpus(tmp_path / "words.jsonl", 40, seed=47)
    names = ["a1", None, "a3", "a2", None, "a1", "a2", "a3"]
    rows = [dict(r, task=names[i % len(names)]) for i, r in enumerate(rows)]
    corpus = write_rows(tmp_path / "c.jsonl", rows)
    lora = lora_overrides(tiny_adapters)
    loads = lora_engine.lora_loads()
    ov = run_overrides(tiny_model_path, corpus, tmp_path / "mixed", *lora, "input.adapter_column=task")
    run = run_local(compose(ov), engine=lora_engine)
    mixed = read_output(run.path)
    loads = lora_engine.lora_loads() - loads
    # the shards' DONE.json hold the engine's own count of this run's loads (not the engine's earlier ones)
    assert sum(read_progress(run.shard_folder(s.index).done_path).adapter_loads for s in run.shards()) == loads
    assert [r["adapter"] for r in mixed] == [r["task"] for r in rows]
    assert all(r["error"] is None for r in mixed)
    # One slot, two windows (32 rows, then 8; max_num_seqs=16), each adapter by adapter, the second
    # going on with the adapter the first ended with: a1 a2 a3, then a3 a1 a2 -> 5 loads (4 when
    # a1 was in the slot already). In row order one slot would take a load at almost every row.
    assert loads in (4, 5), loads
    for name in ("a1", "a2", "a3"):
        ov = run_overrides(tiny_model_path, corpus, tmp_path / name, *lora, f"model.lora.default={name}")
        one = read_output(run_local(compose(ov), engine=lora_engine).path)
        mine = [i for i, r in enumerate(rows) if r["task"] == name]
        assert [mixed[i]["text"] for i in mine] == [one[i]["text"] for i in mine], name
    # the base-model rows answer as a run without adapters (the shared engine without LoRA) does
    plain = read_output(
        run_local(compose(run_overrides(tiny_model_path, corpus, tmp_path / "plain")), engine=engine).path
    )
    assert "adapter" not in plain[0]
    base = [i for i, r in enumerate(rows) if r["task"] is None]
    assert [mixed[i]["text"] for i in base] == [plain[i]["text"] for i in base]
    adapted = [i for i, r in enumerate(rows) if r["task"] is not None]
    assert sum(mixed[i]["text"] != plain[i]["text"] for i in adapted) >= len(adapted) // 2  # adapters change answers
