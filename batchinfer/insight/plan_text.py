"""The `batchinfer plan` report as text: one labelled line per fact, a table for several GPUs."""

from __future__ import annotations

import re
import textwrap
from typing import Optional

from batchinfer.insight.plan_records import (
    EnginesSection,
    GpuRow,
    InputSection,
    ModelSection,
    NodesLayout,
    PlanReport,
    PromptTokens,
)
from batchinfer.logs import plural
from batchinfer.models import sizing
from batchinfer.models.sizing import GB, GIB


def _bin(n: float) -> str:
    # KV sizes in binary units, as vLLM logs them.
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,.0f} B"


POOLED = {"embed": "embedding", "classify": "label", "score": "score"}


def _params(n: int) -> str:
    return f"{n / 1e9:,.2f}B" if n >= 1e9 else f"{n / 1e6:,.1f}M"


def format_plan(report: PlanReport) -> str:
    """The plan as text for people: one labelled line per fact, a table for several GPUs."""
    inp, pt, ms = report["input"], report["prompt_tokens"], report["model"]
    lines = _input_lines(inp) if inp else []
    if pt and "mean" in pt:
        lines += _prompt_lines(inp, pt, ms)
    lines += _model_lines(ms)
    rows, kv = report["gpus"], ms.get("kv_cache", True)
    lines += _one_gpu_lines(rows[0], ms) if len(rows) == 1 else _gpu_table_lines(rows, kv, report.get("engines"))
    lines += _engines_lines(report.get("engines"))
    lines += _warning_lines(rows, kv)
    lines += [f"note     {note}" for note in report["notes"]]
    return "\n".join(_wrap(line) for line in lines)


def _input_lines(inp: InputSection) -> list[str]:
    """Input rows, shards and array tasks."""
    files = f", {inp['files']} files" if inp["files"] > 1 else ""
    return [
        f"input    {inp['path']} ({inp['format']}{files}): {inp['rows']:,} rows",
        f"shards   {plural(inp['shards'], 'shard')} of up to {inp['max_rows_per_shard']:,} rows; "
        f"{plural(inp['array_tasks'], 'array task')} at cluster.shards_per_task={inp['shards_per_task']}",
    ]


def _prompt_lines(inp: Optional[InputSection], pt: PromptTokens, ms: ModelSection) -> list[str]:
    """The sampled prompts' token lengths, the overlong ones, and the tokens the run reads and writes."""
    errs = (
        f", {plural(pt['row_errors'], 'row')} with prompt errors (first: {pt['first_row_error']})"
        if pt["row_errors"]
        else ""
    )
    lines = [
        f"prompts  {pt['mode']} mode, {pt['tokenized_rows']} of {inp['rows']:,} rows tokenized: mean {pt['mean']:,}, "
        f"p50 {pt['p50']:,}, p95 {pt['p95']:,}, max {pt['max']:,} tokens{errs}"
    ]
    if pt["at_or_over_max_model_len"]:
        verb = "exceed" if pt.get("task", "generate") != "generate" else "reach"
        lines.append(
            f"         {pt['at_or_over_max_model_len']} sampled prompts {verb} max_model_len={ms['max_model_len']:,} "
            "(prompt.overlong decides what happens to them)"
        )
    if pt.get("task", "generate") != "generate":
        lines.append(
            f"tokens   input ~{pt['estimated_total']:,} (mean x rows); nothing generated (task={pt['task']}: "
            f"one {POOLED[pt['task']]} per row)"
        )
    else:
        lines.append(
            f"tokens   prompt ~{pt['estimated_total']:,} (mean x rows); output <= {pt['output_upper_bound']:,} "
            f"(rows x max_tokens {pt['max_tokens']} x n {pt['n']})"
        )
    return lines


def _model_lines(ms: ModelSection) -> list[str]:
    """Parameters, weight bytes, and the KV cache per token (or an encoder's activations)."""
    quant = ms["quantization"] or "none"
    per_param = ms["weight_bytes_per_param"]
    kv = ms.get("kv_cache", True)
    kind = "" if kv else f", encoder-only ({ms['architecture']})"
    lines = [
        f"model    {ms['path']}: {_params(ms['params'])} parameters ({ms['params_source']}){kind}",
        f"weights  {per_param:g} byte{'' if per_param == 1 else 's'} per parameter (quantization {quant}) = "
        f"{(ms['weight_bytes'] - ms.get('lora_bytes', 0)) / GB:,.2f} GB",
    ]
    if ms.get("lora_bytes"):
        lines.append(
            f"         + {_bin(ms['lora_bytes'])} of LoRA adapter slots (model.lora: max_loras x max_lora_rank) "
            f"= {ms['weight_bytes'] / GB:,.2f} GB"
        )
    lines += _vision_lines(ms)
    if kv:
        return lines + [
            f"kv       2 (K, V) x {ms['layers']} layers x {ms['kv_heads']} KV heads x head_dim {ms['head_dim']} x "
            f"{ms['kv_bytes_per_element']} bytes (kv_cache_dtype {ms['kv_cache_dtype']})",
            f"         = {_bin(ms['kv_bytes_per_token'])} per token, {_bin(ms['kv_bytes_per_sequence'])} per sequence "
            f"of max_model_len={ms['max_model_len']:,}",
        ]
    act = ms["activation_bytes_per_token"]
    return lines + [
        "kv       none: vLLM runs an encoder-only model (bidirectional attention over the whole text in one "
        "step) without a KV cache",
        f"act      (4 x hidden {ms['hidden_size']:,} + 2 x intermediate {ms['intermediate_size']:,}) x "
        f"{ms['kv_bytes_per_element']} bytes = {_bin(act)} per token in a batch (a layer's live tensors; layers "
        f"run one after another), {_bin(act * ms['max_model_len'])} per sequence of "
        f"max_model_len={ms['max_model_len']:,}",
    ]


def _vision_lines(ms: ModelSection) -> list[str]:
    """A vision-language model's encoder: its weights (in the figure above) and one image's cost."""
    v = ms.get("vision")
    if not v:
        return []
    lines = [
        f"vision   {v['layers']}-layer ViT, hidden {v['hidden_size']:,}, {v['patch_size']} px patches of "
        f"{v['image_size']} px images: {_params(v['params'])} parameters with its connector (in the weights above)"
    ]
    if v["max_image_tokens"] is not None and v["encoder_cache_bytes_per_image"] is not None:
        lines.append(
            f"         the largest image: {v['max_image_tokens']:,} prompt tokens ({v['embedded_tokens']:,} image "
            f"embeddings), {_bin(v['encoder_cache_bytes_per_image'])} of encoder cache; vLLM keeps room for "
            "max(max_num_batched_tokens, one image's) image embeddings"
        )
    return lines + [f"         {v['image_tokens']}"]


def _one_gpu_lines(g: GpuRow, ms: ModelSection) -> list[str]:
    """One GPU's memory: usable, weights, what is left for the KV cache (or activations), and the layout."""
    corpus = ""
    if g["seqs_at_corpus_length"] is not None:
        length = "prompt + max_tokens" if ms.get("task", "generate") == "generate" else "input tokens"
        corpus = f", {sizing.seqs(g['seqs_at_corpus_length'])} of this corpus's mean length ({length})"
    lines = [
        f"gpu      {g['gpu']}, tensor_parallel_size={g['tensor_parallel_size']}{_pp(g)}, "
        f"gpu_memory_utilization={g['gpu_memory_utilization']}"
    ]
    if ms.get("kv_cache", True):
        lines += [
            f"         {g['usable_bytes'] / GB:,.1f} GB usable per GPU - {g['weight_bytes_per_gpu'] / GB:,.2f} GB "
            f"weights = {g['kv_cache_bytes_per_gpu'] / GB:,.2f} GB for the KV cache",
            f"         = {g['kv_tokens']:,} tokens = {sizing.seqs(g['max_seqs_at_max_model_len'])} sequences of "
            f"max_model_len at once{corpus}",
        ]
    else:
        lines += [
            f"         {g['usable_bytes'] / GB:,.1f} GB usable per GPU - {g['weight_bytes_per_gpu'] / GB:,.2f} GB "
            f"weights = {g['activation_bytes_per_gpu'] / GB:,.2f} GB for activations",
            f"         = {g['batch_tokens_fit']:,} tokens per batch = {sizing.seqs(g['max_seqs_at_max_model_len'])} "
            f"sequences of max_model_len{corpus}",
            _batch_note(g),
        ]
    return lines + [f"layout   {g['layout']}"]


def _gpu_table_lines(rows: list[GpuRow], kv: bool, engines: Optional[EnginesSection]) -> list[str]:
    """Several GPUs as a table, each with the smallest tensor-parallel size that fits."""
    tp = rows[0]["tensor_parallel_size"]
    util = rows[0]["gpu_memory_utilization"]
    lines = [
        f"gpus     tensor_parallel_size={tp}{_pp(rows[0])}, gpu_memory_utilization={util}:",
        f"  {'gpu':<11} {'usable/GPU':>10} {'weights/GPU':>11} {'KV/GPU' if kv else 'act/GPU':>9} "
        f"{'KV tokens' if kv else 'batch tok':>11} "
        f"{'seqs@max_len':>12} {'fit TP':>6}",
    ]
    for g in rows:
        fit_tp = str(g["recommended_tp"]) if g["recommended_tp"] else _over_nodes(g.get("recommended_nodes"))
        lines.append(
            f"  {g['gpu']:<11} {g['usable_bytes'] / GB:>7,.1f} GB {g['weight_bytes_per_gpu'] / GB:>8,.1f} GB "
            f"{(g['kv_cache_bytes_per_gpu'] if kv else g['activation_bytes_per_gpu']) / GB:>6,.1f} GB "
            f"{g['kv_tokens'] if kv else g['batch_tokens_fit']:>11,} "
            f"{sizing.seqs(g['max_seqs_at_max_model_len']):>12} {fit_tp:>6}"
        )
    holds = "KV cache holds" if kv else "memory after the weights holds the activations of"
    lines.append(
        f"  fit TP: smallest of {', '.join(map(str, sizing.TP_SIZES))} whose {holds} "
        f"{sizing.MIN_SEQS}+ sequences of max_model_len; 1 means one model copy per GPU"
    )
    for g in rows:  # TPxPP: no one node holds the model; TP inside a node, PP across nodes
        if g.get("recommended_nodes"):
            n = g["recommended_nodes"]
            lines.append(f"  {g['gpu']}: more than one node of {n['gpus_per_node']} GPUs: {n['settings']}")
    if (engines or {}).get("setting", 1) == 1 and any(g["recommended_tp"] == 1 for g in rows):
        lines.append("  (on whole nodes, cluster.engines_per_task=auto runs one copy per GPU in each task)")
    return lines


def _pp(g: GpuRow) -> str:
    """`, pipeline_parallel_size=2 over cluster.nodes_per_task=2 nodes` when the layout has stages."""
    pp, nodes = g.get("pipeline_parallel_size", 1), g.get("nodes_per_task", 1)
    if pp == 1 and nodes == 1:
        return ""
    over = f" over cluster.nodes_per_task={nodes} nodes" if nodes > 1 else ""
    return f" x pipeline_parallel_size={pp}{over}"


def _over_nodes(n: Optional[NodesLayout]) -> str:
    """The fit column of a model no one node holds: `8x2` (TP x PP over nodes), or `-`."""
    return f"{n['tensor_parallel_size']}x{n['pipeline_parallel_size']}" if n else "-"


def _warning_lines(rows: list[GpuRow], kv: bool) -> list[str]:
    """The GPUs' warnings: with several, one line for all the cards the configured layout does not fit."""
    lines = []
    full = [g for g in rows if (g["kv_cache_bytes_per_gpu"] if kv else g["activation_bytes_per_gpu"]) == 0]
    if len(rows) > 1 and full:
        tp = rows[0]["tensor_parallel_size"]
        lines.append(
            f"warning  at tensor_parallel_size={tp} the weights leave no room for {'a KV cache' if kv else 'activations'} "
            f"on {', '.join(g['gpu'] for g in full)}: see fit TP"
        )
    for g in rows:
        for w in [] if len(rows) > 1 and g in full else g["warnings"]:
            lines.append(f"warning  {g['gpu'] + ': ' if len(rows) > 1 else ''}{w}")
    return lines


def _engines_lines(e: Optional[EnginesSection]) -> list[str]:
    """Engines per array task, when a task runs more than one or leaves GPUs idle; what submit would refuse."""
    if not e:
        return []
    if e["problem"]:
        return [f"warning  {e['problem']}"]
    if e.get("nodes"):
        return [f"nodes    {e['nodes']}"]
    n, have, each = e["engines_per_task"], e["gpus_per_task"], e["gpus_per_engine"]
    setting = f"cluster.engines_per_task={e['setting']}"
    if n == 1:
        if not e["idle_gpus"]:
            return []
        fix = (
            f"cluster.engines_per_task=auto runs {have // each} engines"
            if have // each > 1
            else f"lower cluster.gpus_per_task to {each}"
        )
        return [
            f"engines  1 per task ({setting}) on {each} of cluster.gpus_per_task={have} GPUs: "
            f"{e['idle_gpus']} idle; {fix}"
        ]
    if have:
        idle = f", {e['idle_gpus']} idle" if e["idle_gpus"] else ""
        what = (
            f"{plural(each, 'GPU')} each (model.tensor_parallel_size x pipeline_parallel_size) of "
            f"cluster.gpus_per_task={have}{idle}"
        )
    else:
        cpus = e["cpus_per_task"]
        share = (
            f"cluster.cpus_per_task={cpus}: {e['cpus_per_engine']} each"
            if cpus
            else "cluster.cpus_per_task unset: of the cores Slurm gives"
        )
        what = f"the task's CPU cores split {n} ways, no GPUs (cluster.gpus_per_task=0; {share})"
    shards, idle = e["shards_per_task"], e["engines_without_shards"]
    lines = [f"engines  {n} per task ({setting}): {what}"]
    if idle:
        lines.append(
            f"warning  {plural(shards, 'shard')} per task for {n} engines: {idle} of them get none; raise "
            f"cluster.shards_per_task to {n} or more (the input needs that many shards too)"
        )
    else:
        per = e["shards_per_engine"]
        lines.append(
            f"         about {per:g} shard{'' if per == 1 else 's'} per engine ({plural(shards, 'shard')} per task, "
            "cluster.shards_per_task), taken one at a time: a faster engine takes more"
        )
    return lines


def _batch_note(g: GpuRow) -> str:
    """What bounds an encoder's batch: vLLM's max_num_batched_tokens, or the memory when it is smaller."""
    batch = g["max_num_batched_tokens"]
    if g["batch_tokens_fit"] >= batch:
        return (
            f"         vLLM schedules up to max_num_batched_tokens={batch:,} per step: memory does not limit the "
            "batch, compute does"
        )
    return (
        f"         fewer than max_num_batched_tokens={batch:,}: set model.max_num_batched_tokens="
        f"{g['batch_tokens_fit']:,} or lower"
    )


def _wrap(line: str, width: int = 110) -> str:
    # Long lines continue under their text, past the 9-character label; table rows stay whole.
    if len(line) <= width or (line.startswith("  ") and not line.startswith(" " * 9)):
        return line
    line = re.sub(r"(\d) (?=GB|GiB|MiB|KiB|B\b|tokens|sequences)", "\\1\u00a0", line)  # keep units with numbers
    return textwrap.fill(
        line, width, subsequent_indent=" " * 9, break_on_hyphens=False, break_long_words=False
    ).replace("\u00a0", " ")
