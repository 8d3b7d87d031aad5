"""What vLLM will do with a row's request, known without vllm: the checks its SamplingParams, its
add_request (the logprobs cap) and its structured-output validation make, in one place. `validate`,
`plan`, `run` and the worker call `refusal` (build_request: every row's sampling; config checks: the
config's own, before DIR is made); tests/contract/test_request_verdict.py feeds one table of values
to it and to vLLM's own classes and fails where they disagree."""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

from batchinfer.config.vllm_names import MAX_LOGPROBS
from batchinfer.requests.schemas import schema_problem

GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a lower temperature samples greedily
MAX_N = 16384  # vLLM's VLLM_MAX_N_SEQUENCES default
INT64 = 2**63  # a seed reaches torch.Generator.manual_seed, which takes a signed 64-bit integer
CONSTRAINTS = ("choice", "regex", "json", "grammar")
STRUCTURED_KEYS = frozenset({*CONSTRAINTS, "disable_any_whitespace", "disable_additional_properties"})


@dataclass(frozen=True)
class Limits:
    """What vLLM's checks of a request depend on beyond the request itself."""

    max_logprobs: int = MAX_LOGPROBS  # model.engine_kwargs.max_logprobs; -1: the whole vocabulary
    vocab_size: Optional[int] = None  # the model's (config.json); None: unknown, not checked


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


def limits(model_path: Optional[str], revision: Optional[str], engine_kwargs: Optional[Mapping[str, Any]]) -> Limits:
    """The limits of a run's model: max_logprobs from model.engine_kwargs, the vocabulary from config.json."""
    cap = (engine_kwargs or {}).get("max_logprobs", MAX_LOGPROBS)
    return Limits(cap if isinstance(cap, int) else MAX_LOGPROBS, _vocab_size(model_path, revision))


def _number(v: Any) -> bool:
    return isinstance(v, (int, float))


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
    "max_tokens": (int.__instancecheck__, _INT, lambda v: v >= 1, "an integer >= 1"),
    "min_tokens": (int.__instancecheck__, _INT, lambda v: v >= 0, "an integer >= 0"),
    "logprobs": (int.__instancecheck__, _INT, lambda v: v >= -1, "an integer >= 0 (-1: the whole vocabulary)"),
    "seed": (int.__instancecheck__, _INT, lambda v: -INT64 <= v < INT64, "an integer in [-2^63, 2^63)"),
    "ignore_eos": (bool.__instancecheck__, "true or false", lambda v: True, ""),
    "skip_special_tokens": (bool.__instancecheck__, "true or false", lambda v: True, ""),
    "stop": (
        lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v),
        "a list of strings",
        lambda v: True,
        "",
    ),
}


def _value_refusal(key: str, value: Any) -> Optional[Refusal]:
    is_type, kind, in_range, takes = RULES[key]
    if not is_type(value) or (kind != "true or false" and isinstance(value, bool)):
        return Refusal(key, value, f"is not {kind}")
    if kind == _NUM and not math.isfinite(value):
        return Refusal(key, value, f"is not a finite number: vLLM refuses inf and nan; it takes {takes}")
    if key == "stop" and any(s == "" for s in value):
        return Refusal(key, value, 'has an empty string: vLLM refuses it (it would stop at once); drop the ""')
    if not in_range(value):
        return _takes(key, value, takes)
    return None


def refusal(params: Mapping[str, Any], limits: Limits = Limits(), in_row: bool = True) -> Optional[Refusal]:
    """Why vLLM refuses a request with these sampling values (SamplingParams names, structured_outputs
    as a dict), or None when it takes them. Keys it does not know are not its to judge. in_row:
    the values hold a row's own (see structured_refusal); False for the config's alone."""
    for key, value in params.items():
        if key in RULES and value is not None:
            found = _value_refusal(key, value)
            if found:
                return found
    return _cross_refusal(params, limits) or structured_refusal(params.get("structured_outputs"), in_row)


def _cross_refusal(p: Mapping[str, Any], limits: Limits) -> Optional[Refusal]:
    """The rules between keys and against the model: min_tokens, greedy n, logprobs cap, vocabulary."""
    max_tokens, min_tokens = p.get("max_tokens"), p.get("min_tokens") or 0
    if max_tokens is not None and min_tokens > max_tokens:
        return _takes("min_tokens", min_tokens, f"at most max_tokens={max_tokens}")
    if (p.get("n") or 1) > 1 and (p.get("temperature") or 0) < GREEDY_BELOW:
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


# Regex syntax Python's `re` takes and vLLM's grammar backends refuse (xgrammar, then guidance under
# the default backend "auto"; tests/contract/test_request_verdict.py holds the list against them):
# lookarounds, backreferences, conditionals, atomic groups, word boundaries, {,n} without a lower bound.
_UNSUPPORTED_REGEX = re.compile(r"\(\?(?:[=!>(]|<[=!]|P=)|\\[1-9bB]|\\[kg]<|\{,")


def regex_problem(pattern: str) -> Optional[str]:
    """Why vLLM's structured outputs refuse a regex, or None."""
    if "\x00" in pattern:
        return "a regex without a NUL character"
    try:
        re.compile(pattern)
    except re.error as e:
        return f"a valid regex ({e})"
    found = _UNSUPPORTED_REGEX.search(pattern)
    if found:
        return f"a regex without {found.group(0)!r} (lookarounds, backreferences, word boundaries are not supported)"
    return None


def structured_refusal(so: Any, in_row: bool = True) -> Optional[Refusal]:
    """Why vLLM refuses a structured_outputs value, or None (None and {} constrain nothing). In a
    row's own data a json schema must be an object written inline: a string there would be read
    as a path to a file on the compute node (paths belong in the run's config, frozen into DIR)."""
    if so is None:
        return None
    if not isinstance(so, Mapping):
        return Refusal("structured_outputs", so, "is not an object with one of: " + ", ".join(CONSTRAINTS))
    unknown = sorted(set(so) - STRUCTURED_KEYS)
    if unknown:
        return Refusal(
            "structured_outputs", dict(so), f"has unknown keys {unknown}: it takes {', '.join(sorted(STRUCTURED_KEYS))}"
        )
    given = [k for k in CONSTRAINTS if so.get(k) is not None]
    if len(given) > 1:
        return Refusal(
            "structured_outputs", dict(so), f"sets {', '.join(given)}: vLLM takes one of {', '.join(CONSTRAINTS)}"
        )
    if not given:
        return None
    key, value = given[0], so[given[0]]
    why = _constraint_problem(key, value, in_row)
    return Refusal(f"structured_outputs.{key}", value, f"is refused by vLLM: it takes {why}") if why else None


def _constraint_problem(key: str, value: Any, in_row: bool) -> Optional[str]:
    if key == "choice":
        ok = isinstance(value, list) and value and all(isinstance(c, str) for c in value)
        return None if ok else "a non-empty list of strings"
    if key == "regex":
        return regex_problem(value) if isinstance(value, str) else "a string"
    if key == "grammar":
        return None if isinstance(value, str) and value.strip() else "a non-empty grammar string"
    if in_row and not isinstance(value, Mapping):
        return "a JSON schema object written inline (a file's path is taken only in the run's config)"
    if isinstance(value, Mapping):
        problem = schema_problem(dict(value))
        return f"a JSON schema: {problem}" if problem else None
    return None  # the config's inline JSON text or file: config/json_schema.py checks it


def engine_refusal(e: Exception, kind: str, what: str) -> Any:
    """A RowError for an exception the engine raised on one request: `kind` (sampling while building
    its SamplingParams, engine_refused while accepting it), the exception's type and text quoted."""
    from batchinfer.requests.prompts import RowError

    if isinstance(e, RowError):
        return e
    if getattr(e, "parameter", None) in RULES:  # vLLM's VLLMValidationError names the sampling key
        kind = "sampling"
    return RowError(kind, f"{what}: {type(e).__name__}: {e}")
