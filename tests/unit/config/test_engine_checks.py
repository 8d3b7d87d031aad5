"""Values vLLM or Slurm refuse only at engine start or sbatch, refused at compose (validate, plan,
run and submit start there, before DIR is made) naming the key and what it takes: engine_kwargs
that duplicate batchinfer's own keys or carry a value vLLM refuses, model.seed, the batch budget,
LoRA ranks, Slurm's signal lead, time and memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchinfer.config.compose import compose
from batchinfer.config.schema import to_config
from batchinfer.engine.engine_args import llm_kwargs
from batchinfer.errors import ConfigError


def adapter(parent: Path, name: str, r: int) -> Path:
    """A PEFT adapter folder of rank r, as far as compose reads it."""
    d = parent / name
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": 2 * r}))
    return d


def _refused(overrides: list[str], message: str) -> str:
    with pytest.raises(ConfigError) as e:
        compose(overrides)
    assert message in str(e.value), str(e.value)
    return str(e.value)


@pytest.mark.parametrize(
    "name, key",
    [
        ("max_model_len", "model.max_model_len"),  # validate would judge rows by model.max_model_len
        ("model", "model.path"),
        ("tokenizer", "model.path"),
        ("seed", "model.seed"),
        ("tensor_parallel_size", "model.tensor_parallel_size"),
        ("max_num_seqs", "model.max_num_seqs"),
        ("enforce_eager", "model.enforce_eager"),
        ("dtype", "model.dtype"),
        ("max_lora_rank", "model.lora.max_lora_rank"),
    ],
)
def test_engine_kwargs_duplicating_a_key_of_batchinfer_is_refused_naming_both(name: str, key: str) -> None:
    _refused(
        [f"+model.engine_kwargs.{name}=10"],
        f"model.engine_kwargs.{name} duplicates {key}, which batchinfer passes to vLLM and checks (validate, plan "
        f"and the row check read it); set {key} instead and remove model.engine_kwargs.{name}",
    )


@pytest.mark.parametrize(
    "override, takes",
    [
        ("+model.engine_kwargs.data_parallel_size=abc", "data_parallel_size='abc': vLLM takes an integer >= 1"),
        ("+model.engine_kwargs.data_parallel_size=0", "data_parallel_size=0: vLLM takes an integer >= 1"),
        ("+model.engine_kwargs.max_logprobs=-5", "max_logprobs=-5: vLLM takes an integer >= -1"),
        ("+model.engine_kwargs.enable_chunked_prefill=maybe", "enable_chunked_prefill='maybe': vLLM takes true or"),
        ("+model.engine_kwargs.async_scheduling=1", "async_scheduling=1: vLLM takes true or false"),
        ("+model.engine_kwargs.num_gpu_blocks_override=2.5", "num_gpu_blocks_override=2.5: vLLM takes an integer"),
    ],
)
def test_engine_kwargs_values_vllm_refuses_are_refused(override: str, takes: str) -> None:
    _refused([override], f"model.engine_kwargs.{takes}")


def test_engine_kwargs_values_vllm_takes_pass() -> None:
    cfg = compose(["+model.engine_kwargs.data_parallel_size=2", "+model.engine_kwargs.enable_chunked_prefill=false"])
    assert llm_kwargs(to_config(cfg))["data_parallel_size"] == 2


@pytest.mark.parametrize("seed", ["4294967296", "-1", "18446744073709551616"])
def test_model_seed_outside_numpy_s_range_is_refused(seed: str) -> None:
    _refused([f"model.seed={seed}"], f"model.seed={seed} is out of range: it takes an integer from 0 to 2**32 - 1")
    assert compose(["model.seed=4294967295"]).model.seed == 4294967295


def test_batch_budget_below_max_num_seqs_is_refused() -> None:
    _refused(
        ["model.max_num_batched_tokens=8", "model.max_num_seqs=16"],
        "model.max_num_batched_tokens=8 is below model.max_num_seqs=16",
    )
    compose(["model.max_num_batched_tokens=16", "model.max_num_seqs=16"])


def test_max_lora_rank_vllm_does_not_take_or_below_an_adapter_is_refused(tmp_path: Path) -> None:
    a8 = f"+model.lora.adapters.a1={adapter(tmp_path, 'a1', 8)}"
    _refused([a8, "model.lora.max_lora_rank=100000"], "model.lora.max_lora_rank=100000: vLLM takes one of 1, 8, 16")
    _refused([a8, "model.lora.max_lora_rank=3"], "set model.lora.max_lora_rank=8, or unset it")
    _refused(
        [a8, "model.lora.max_lora_rank=1"],
        "model.lora.adapters.a1 has rank r=8, above model.lora.max_lora_rank=1: vLLM would refuse to load it",
    )
    # unset: the largest adapter rank rounded up to one vLLM takes (r=4 -> 8)
    a4 = f"+model.lora.adapters.a4={adapter(tmp_path, 'a4', 4)}"
    assert llm_kwargs(to_config(compose([a4])))["max_lora_rank"] == 8


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["cluster.signal_lead_s=100000"], "cluster.signal_lead_s=100000 is out of range: it takes an integer number"),
        (
            ["cluster.time=2", "cluster.signal_lead_s=120"],
            "cluster.signal_lead_s=120 is not shorter than cluster.time=2",
        ),
        (["cluster.time=9223372036854775807"], "cluster.time=9223372036854775807 is out of range: it takes an integer"),
        (["cluster.mem=abc"], "cluster.mem='abc' is not a memory size Slurm reads"),
        (["cluster.merge_mem=4 GB"], "cluster.merge_mem='4 GB' is not a memory size Slurm reads"),
    ],
)
def test_slurm_values_sbatch_refuses_are_refused(overrides: list[str], message: str) -> None:
    _refused(overrides, message)


def test_slurm_values_sbatch_takes_pass() -> None:
    cfg = compose(["cluster.mem=64G", "cluster.merge_mem=4000", "cluster.signal_lead_s=65535", "cluster.time=2000"])
    assert (cfg.cluster.mem, cfg.cluster.signal_lead_s) == ("64G", 65535)
