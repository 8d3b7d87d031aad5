"""`batchinfer plan`: rows, shards, prompt tokens from a sample, weights and KV cache per GPU. No engine."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Optional

from batchinfer import sizing
from batchinfer.config import DEFAULT_ROWS_PER_SHARD
from batchinfer.errors import ConfigError
from batchinfer.sizing import GB, GIB

SAMPLE_ROWS = 200


def _percentile(values: list[int], q: float) -> int:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def input_section(c: dict[str, Any], sample_rows: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Input rows, shards and array tasks, plus a sample of rows; reads the input, converts nothing."""
    from batchinfer.data import detect_format, input_files, plan_shards
    from batchinfer.preview import peek

    files = input_files(c["input"]["path"])
    fmt = detect_format(files, c["input"]["format"])
    rows, sample = peek(files, fmt, sample_rows)
    if rows == 0:
        raise ConfigError(f"input.path {c['input']['path']}: no rows; there is nothing to plan")
    sh = c["sharding"]
    shards = plan_shards(rows, sh["num_shards"], sh["rows_per_shard"], DEFAULT_ROWS_PER_SHARD)
    per_task = c["cluster"]["shards_per_task"]
    section = {
        "path": c["input"]["path"],
        "files": len(files),
        "format": fmt,
        "rows": rows,
        "shards": len(shards),
        "max_rows_per_shard": max(s.rows for s in shards),
        "shards_per_task": per_task,
        "array_tasks": math.ceil(len(shards) / per_task),
    }
    return section, sample


def prompt_section(
    c: dict[str, Any], folder: Path, rows: int, sample: list[dict[str, Any]], max_len: int
) -> dict[str, Any]:
    """Prompt tokens of the sampled rows, counted as vLLM would, and the totals they suggest."""
    from jinja2.exceptions import TemplateError

    from batchinfer.prompts import PromptBuilder, RowError, check_fields
    from batchinfer.tokens import LoginTokenizer

    builder = PromptBuilder(c["prompt"])
    columns = sorted({k for row in sample for k in row})
    check_fields(builder.template, columns, c["input"]["path"])
    tok = LoginTokenizer.from_model_dir(folder)
    if c["prompt"]["mode"] == "chat" and tok.chat_template is None:
        raise ConfigError(f"model.path {c['model']['path']}: the model has no chat template; use prompt.mode=raw")
    kwargs = c["prompt"]["chat_template_kwargs"]
    counts: list[int] = []
    errors: list[str] = []
    for row in sample:
        try:
            counts.append(tok.count(builder.build(row), kwargs))
        except (RowError, TemplateError) as e:
            errors.append(str(e))  # an error row in a run, not a failed plan
    sampling = c["sampling"]
    out = {
        "mode": c["prompt"]["mode"],
        "sampled_rows": len(sample),
        "tokenized_rows": len(counts),
        "row_errors": len(errors),
        "first_row_error": errors[0] if errors else None,
        "output_upper_bound": rows * sampling["max_tokens"] * sampling["n"],
        "max_tokens": sampling["max_tokens"],
        "n": sampling["n"],
    }
    if counts:
        mean = sum(counts) / len(counts)
        out |= {
            "mean": round(mean, 1),
            "p50": _percentile(counts, 0.5),
            "p95": _percentile(counts, 0.95),
            "max": max(counts),
            "estimated_total": round(mean * rows),
            "at_or_over_max_model_len": sum(1 for n in counts if n >= max_len),
        }
    return out


def model_section(c: dict[str, Any], folder: Path) -> tuple[sizing.ModelSize, dict[str, Any]]:
    """Parameters, weight bytes and KV bytes per token of the configured model and quantization."""
    m, q = c["model"], c["quantization"]
    model = sizing.read_model(folder)
    max_len = m["max_model_len"] or model.max_position
    if not max_len:
        raise ConfigError(f"{folder}/config.json has no max_position_embeddings: set model.max_model_len")
    method = q["method"]
    if model.quant_method:
        method = model.quant_method  # the checkpoint's own; vLLM reads it from config.json
    wbytes = sizing.weight_bytes(model, q["method"], m["dtype"])
    kv_bytes = sizing.kv_dtype_bytes(q["kv_cache_dtype"], m["dtype"])
    per_token = sizing.kv_bytes_per_token(model, kv_bytes)
    return model, {
        "path": m["path"],
        "folder": str(folder),
        "params": model.params,
        "params_source": model.params_source,
        "layers": model.layers,
        "kv_heads": model.kv_heads,
        "head_dim": model.head_dim,
        "quantization": method,
        "checkpoint_quantized": model.quant_method is not None,
        "weight_bytes_per_param": sizing.weight_bytes_per_param(model, q["method"], m["dtype"]),
        "weight_bytes": wbytes,
        "kv_cache_dtype": q["kv_cache_dtype"],
        "kv_bytes_per_element": kv_bytes,
        "kv_bytes_per_token": per_token,
        "max_model_len": max_len,
        "kv_bytes_per_sequence": per_token * max_len,
    }


def gpu_rows(
    c: dict[str, Any], model: sizing.ModelSize, ms: dict[str, Any], gpus: list[str], seq_len: Optional[int]
) -> list[dict[str, Any]]:
    """One row per GPU preset: memory per GPU, KV tokens, concurrency, layout advice and warnings."""
    m = c["model"]
    util, tp = m["gpu_memory_utilization"], m["tensor_parallel_size"]
    out = []
    for gpu in gpus:
        adv = sizing.advice(model, ms["weight_bytes"], ms["kv_bytes_per_element"], gpu, util, tp, ms["max_model_len"])
        f = adv["fit"]
        out.append(
            {
                "gpu": gpu,
                "gpu_gb": f.gpu_gb,
                "gpu_memory_utilization": util,
                "tensor_parallel_size": tp,
                "usable_bytes": f.usable,
                "weight_bytes_per_gpu": f.weights,
                "kv_cache_bytes_per_gpu": f.kv_free,
                "kv_tokens": f.kv_tokens,
                "max_seqs_at_max_model_len": round(f.max_seqs, 2),
                "seqs_at_corpus_length": round(f.kv_tokens / seq_len, 1) if seq_len else None,
                "recommended_tp": adv["recommended_tp"],
                "layout": adv["layout"],
                "warnings": adv["warnings"],
            }
        )
    return out


def estimate(c: dict[str, Any], gpu: str = sizing.DEFAULT_GPU, sample_rows: int = SAMPLE_ROWS) -> dict[str, Any]:
    """The whole plan of a resolved config dict: input, prompt tokens, model, GPUs."""
    from batchinfer.tokens import model_dir

    if not c["model"]["path"]:
        raise ConfigError("model.path is not set: add model.path=/path/to/hf-model-folder or a preset")
    gpus = sizing.gpu_names(gpu)
    try:
        folder = model_dir(c["model"]["path"], c["model"]["revision"])
    except ConfigError as e:
        if "Hugging Face cache" not in str(e):
            raise
        name = c["model"]["path"]
        raise ConfigError(
            f"{e}. For `plan` alone the small files are enough: `huggingface-cli download {name} config.json "
            f"tokenizer.json tokenizer_config.json`"
        ) from None
    model, ms = model_section(c, folder)
    report: dict[str, Any] = {"input": None, "prompt_tokens": None, "model": ms, "notes": []}
    if model.quant_method and c["quantization"]["method"]:
        report["notes"].append(
            f"the checkpoint is quantized ({model.quant_method}); quantization.method="
            f"{c['quantization']['method']} is not used for sizing"
        )
    if c["input"]["path"]:
        report["input"], sample = input_section(c, sample_rows)
        if (folder / "tokenizer.json").is_file():
            report["prompt_tokens"] = prompt_section(c, folder, report["input"]["rows"], sample, ms["max_model_len"])
        else:
            report["notes"].append(f"{folder} has no tokenizer.json: prompt tokens not estimated")
    else:
        report["notes"].append("input.path is not set: sizing only")
    pt = report["prompt_tokens"]
    seq_len = round(pt["mean"] + pt["max_tokens"]) if pt and "mean" in pt else None
    report["gpus"] = gpu_rows(c, model, ms, gpus, seq_len)
    return report


def _bin(n: float) -> str:
    # KV sizes in binary units, as vLLM logs them.
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,.0f} B"


def _n(count: int, word: str) -> str:
    return f"{count:,} {word}{'' if count == 1 else 's'}"


def _params(n: int) -> str:
    return f"{n / 1e9:,.2f}B" if n >= 1e9 else f"{n / 1e6:,.1f}M"


def format_plan(report: dict[str, Any]) -> str:
    """The plan as text for people: one labelled line per fact, a table for several GPUs."""
    lines = []
    inp, pt, ms = report["input"], report["prompt_tokens"], report["model"]
    if inp:
        files = f", {inp['files']} files" if inp["files"] > 1 else ""
        lines.append(f"input    {inp['path']} ({inp['format']}{files}): {inp['rows']:,} rows")
        lines.append(
            f"shards   {_n(inp['shards'], 'shard')} of up to {inp['max_rows_per_shard']:,} rows; "
            f"{_n(inp['array_tasks'], 'array task')} at cluster.shards_per_task={inp['shards_per_task']}"
        )
    if pt and "mean" in pt:
        errs = (
            f", {_n(pt['row_errors'], 'row')} with prompt errors (first: {pt['first_row_error']})"
            if pt["row_errors"]
            else ""
        )
        lines.append(
            f"prompts  {pt['mode']} mode, {pt['tokenized_rows']} of {inp['rows']:,} rows tokenized: mean {pt['mean']:,}, "
            f"p50 {pt['p50']:,}, p95 {pt['p95']:,}, max {pt['max']:,} tokens{errs}"
        )
        if pt["at_or_over_max_model_len"]:
            lines.append(
                f"         {pt['at_or_over_max_model_len']} sampled prompts reach max_model_len={ms['max_model_len']:,} "
                "(prompt.overlong decides what happens to them)"
            )
        lines.append(
            f"tokens   prompt ~{pt['estimated_total']:,} (mean x rows); output <= {pt['output_upper_bound']:,} "
            f"(rows x max_tokens {pt['max_tokens']} x n {pt['n']})"
        )
    quant = ms["quantization"] or "none"
    per_param = ms["weight_bytes_per_param"]
    lines.append(f"model    {ms['path']}: {_params(ms['params'])} parameters ({ms['params_source']})")
    lines.append(
        f"weights  {per_param:g} byte{'' if per_param == 1 else 's'} per parameter (quantization {quant}) = "
        f"{ms['weight_bytes'] / GB:,.2f} GB"
    )
    lines.append(
        f"kv       2 (K, V) x {ms['layers']} layers x {ms['kv_heads']} KV heads x head_dim {ms['head_dim']} x "
        f"{ms['kv_bytes_per_element']} bytes (kv_cache_dtype {ms['kv_cache_dtype']})"
    )
    lines.append(
        f"         = {_bin(ms['kv_bytes_per_token'])} per token, {_bin(ms['kv_bytes_per_sequence'])} per sequence of "
        f"max_model_len={ms['max_model_len']:,}"
    )
    rows = report["gpus"]
    if len(rows) == 1:
        g = rows[0]
        corpus = ""
        if g["seqs_at_corpus_length"] is not None:
            corpus = f", {sizing.seqs(g['seqs_at_corpus_length'])} of this corpus's mean length (prompt + max_tokens)"
        lines.append(
            f"gpu      {g['gpu']}, tensor_parallel_size={g['tensor_parallel_size']}, "
            f"gpu_memory_utilization={g['gpu_memory_utilization']}"
        )
        lines.append(
            f"         {g['usable_bytes'] / GB:,.1f} GB usable per GPU - {g['weight_bytes_per_gpu'] / GB:,.2f} GB "
            f"weights = {g['kv_cache_bytes_per_gpu'] / GB:,.2f} GB for the KV cache"
        )
        lines.append(
            f"         = {g['kv_tokens']:,} tokens = {sizing.seqs(g['max_seqs_at_max_model_len'])} sequences of "
            f"max_model_len at once{corpus}"
        )
        lines.append(f"layout   {g['layout']}")
    else:
        tp = rows[0]["tensor_parallel_size"]
        util = rows[0]["gpu_memory_utilization"]
        lines.append(f"gpus     tensor_parallel_size={tp}, gpu_memory_utilization={util}:")
        lines.append(
            f"  {'gpu':<11} {'usable/GPU':>10} {'weights/GPU':>11} {'KV/GPU':>9} {'KV tokens':>11} "
            f"{'seqs@max_len':>12} {'fit TP':>6}"
        )
        for g in rows:
            fit_tp = str(g["recommended_tp"]) if g["recommended_tp"] else "-"
            lines.append(
                f"  {g['gpu']:<11} {g['usable_bytes'] / GB:>7,.1f} GB {g['weight_bytes_per_gpu'] / GB:>8,.1f} GB "
                f"{g['kv_cache_bytes_per_gpu'] / GB:>6,.1f} GB {g['kv_tokens']:>11,} "
                f"{sizing.seqs(g['max_seqs_at_max_model_len']):>12} {fit_tp:>6}"
            )
        lines.append(
            f"  fit TP: smallest of {', '.join(map(str, sizing.TP_SIZES))} whose KV cache holds "
            f"{sizing.MIN_SEQS}+ sequences of max_model_len; 1 means one model copy per GPU"
        )
    for g in rows:
        for w in g["warnings"]:
            lines.append(f"warning  {g['gpu'] + ': ' if len(rows) > 1 else ''}{w}")
    for note in report["notes"]:
        lines.append(f"note     {note}")
    return "\n".join(_wrap(line) for line in lines)


def _wrap(line: str, width: int = 110) -> str:
    # Long lines continue under their text, past the 9-character label; table rows stay whole.
    if len(line) <= width or (line.startswith("  ") and not line.startswith(" " * 9)):
        return line
    import textwrap

    line = re.sub(r"(\d) (?=GB|GiB|MiB|KiB|B\b|tokens|sequences)", "\\1\u00a0", line)  # keep units with numbers
    return textwrap.fill(
        line, width, subsequent_indent=" " * 9, break_on_hyphens=False, break_long_words=False
    ).replace("\u00a0", " ")
