"""config/checks.ENGINE_KWARG_VALUES (the model.engine_kwargs values refused at compose) and
OWN_KEYS held against the installed vLLM's config dataclasses: a value refused at compose is one
vLLM's pydantic field refuses, and one taken is one it takes. No engine starts."""

from __future__ import annotations

import importlib.util
from typing import Annotated, Any

import pytest

from batchinfer.config.checks import ENGINE_KWARG_VALUES, OWN_KEYS, engine_kwarg_ok
from batchinfer.config.vllm_names import ENGINE_ARGS, LORA_RANKS

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
PROBES: dict[type, list[Any]] = {
    int: [-5, -1, 0, 1, 3, 2.5, "abc"],
    float: [-5, -0.5, 0, 0.5, 1, 3, "abc"],
    bool: [True, False, "maybe", "abc"],
}


def _field(name: str) -> Any:
    """The pydantic field of vLLM's config dataclasses named name."""
    from vllm import config

    for cls in (
        config.ModelConfig,
        config.CacheConfig,
        config.SchedulerConfig,
        config.ParallelConfig,
        config.ObservabilityConfig,
        config.LoadConfig,
    ):
        fields = getattr(cls, "__pydantic_fields__", {})
        if name in fields:
            return fields[name]
    raise AssertionError(f"{name} is a field of none of vLLM's config dataclasses")


def _vllm_takes(field: Any, value: Any) -> bool:
    from pydantic import TypeAdapter, ValidationError

    kind = Annotated.__class_getitem__((field.annotation, *field.metadata)) if field.metadata else field.annotation  # type: ignore[attr-defined]
    try:
        TypeAdapter(kind).validate_python(value)
    except ValidationError:
        return False
    return True


@pytest.mark.parametrize("name", sorted(ENGINE_KWARG_VALUES))
def test_engine_kwarg_values_refused_are_those_vllm_refuses(name: str) -> None:
    field = _field(name)
    kind = ENGINE_KWARG_VALUES[name][0]
    for value in PROBES[kind]:
        assert engine_kwarg_ok(name, value) == _vllm_takes(field, value), (name, value)


def test_own_keys_are_engine_args() -> None:
    """Each engine_kwargs name refused as a duplicate is one vLLM's EngineArgs takes (a stale one would hide nothing)."""
    assert sorted(set(OWN_KEYS) - set(ENGINE_ARGS)) == []


def test_lora_ranks_are_vllm_s() -> None:
    import typing

    from vllm.config.lora import MaxLoRARanks

    assert typing.get_args(MaxLoRARanks) == LORA_RANKS
