"""The `batchinfer plan` report as text: one labelled line per fact, a table for several GPUs."""

from __future__ import annotations

import re
import textwrap
from typing import Any

from batchinfer.models import sizing
from batchinfer.models.sizing import GB, GIB


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
    full = [g for g in rows if g["kv_cache_bytes_per_gpu"] == 0]
    if len(rows) > 1 and full:  # one line for all the cards the configured layout does not fit
        tp = rows[0]["tensor_parallel_size"]
        lines.append(
            f"warning  at tensor_parallel_size={tp} the weights leave no room for a KV cache on "
            f"{', '.join(g['gpu'] for g in full)}: see fit TP"
        )
    for g in rows:
        for w in [] if len(rows) > 1 and g in full else g["warnings"]:
            lines.append(f"warning  {g['gpu'] + ': ' if len(rows) > 1 else ''}{w}")
    for note in report["notes"]:
        lines.append(f"note     {note}")
    return "\n".join(_wrap(line) for line in lines)


def _wrap(line: str, width: int = 110) -> str:
    # Long lines continue under their text, past the 9-character label; table rows stay whole.
    if len(line) <= width or (line.startswith("  ") and not line.startswith(" " * 9)):
        return line
    line = re.sub(r"(\d) (?=GB|GiB|MiB|KiB|B\b|tokens|sequences)", "\\1\u00a0", line)  # keep units with numbers
    return textwrap.fill(
        line, width, subsequent_indent=" " * 9, break_on_hyphens=False, break_long_words=False
    ).replace("\u00a0", " ")
