"""An engine over several nodes: every engine argument the head runs with, defaults included, is the
one each rank runs with. The head's arguments are the ones vLLM's LLM builds (caught where LLM
hands them to its engine, before any process starts); a rank's are run_headless's. Real vLLM,
no engine started."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from support.runs import model_overrides

from batchinfer.config.compose import compose
from batchinfer.config.nodes import NodeGroup
from batchinfer.engine import vllm_engine


class Caught(Exception):
    """Raised where LLM would start its engine: its EngineArgs are caught."""


def head_engine_args(cfg: Any, group: NodeGroup, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The EngineArgs vLLM's LLM builds for the head's Engine, resolved as its engine resolves them."""
    from vllm.v1.engine.llm_engine import LLMEngine

    caught: dict[str, Any] = {}

    def from_engine_args(cls: Any, engine_args: Any, usage_context: Any, **kw: Any) -> Any:
        caught.update(args=engine_args, usage=usage_context)
        raise Caught

    monkeypatch.setattr(LLMEngine, "from_engine_args", classmethod(from_engine_args))
    with pytest.raises(Caught):
        vllm_engine.Engine(cfg, "float32", group)
    caught["args"].create_engine_config(usage_context=caught["usage"])
    return caught["args"]


def test_every_engine_argument_of_the_head_reaches_the_ranks(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    cfg = compose([*model_overrides(tiny_model_path), "model.tensor_parallel_size=2", "model.max_num_seqs=null"])
    group = NodeGroup(nnodes=2, master_addr="127.0.0.1", master_port=29871)
    group = dataclasses.replace(group, engine_args=vllm_engine.head_defaults(cfg, "float32", group))
    # resolved on the head: the offline engine's defaults (8192 batched tokens on CPU with TP 2,
    # where a rank left to itself took the API server's 4096)
    assert group.engine_args["max_num_batched_tokens"] == 8192
    head = head_engine_args(cfg, group, monkeypatch)
    rank, _ = vllm_engine.rank_config(cfg, "float32", group, 1)
    differ = {
        f.name: (getattr(head, f.name), getattr(rank, f.name))
        for f in dataclasses.fields(head)
        if getattr(head, f.name) != getattr(rank, f.name)
    }
    assert differ == {"node_rank": (0, 1)}
    assert rank.max_num_batched_tokens == 8192 and rank.worker_cls == "batchinfer.engine.vllm_engine.RankWorker"
