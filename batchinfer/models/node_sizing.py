"""Sizing an engine over several nodes (cluster.nodes_per_task): weights and KV cache per GPU at
tensor x pipeline parallel, and the fewest nodes that hold a model no single node holds.

Pipeline parallel splits the layers over its stages, so a GPU holds 1/(TP x PP) of the weights and
the KV cache of its stage's layers only: ceil(layers / PP) of them, each with its share of the KV
heads over TP. The layout proposed is the one vLLM's documentation recommends for several nodes:
tensor parallel inside a node (TP = GPUs per node), pipeline parallel across nodes (PP = nodes)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from batchinfer.models import sizing
from batchinfer.models.advice import Advice, advice
from batchinfer.models.sizing import GB, Fit, ModelSize

MAX_NODES = 16  # the largest layout proposed: beyond it, quantize or choose a smaller model


@dataclass
class NodeFit(Fit):
    """A Fit at tensor x pipeline parallel: pp stages, over `nodes` nodes of `gpus_per_node` GPUs."""

    pp: int = 1
    nodes: int = 1
    gpus_per_node: int = sizing.TP_SIZES[-1]


class NodeAdvice(Advice):
    """advice.Advice at tensor x pipeline parallel, with the fewest nodes that hold a model no one node does."""

    nodes: Optional[NodeFit]


def stage_token_bytes(model: ModelSize, elem_bytes: int, tp: int, pp: int) -> int:
    """Memory per token on one GPU of a TP x PP engine: its stage's layers' KV (an encoder-only
    model: one batch's activations, which pipeline stages do not split)."""
    per_token = sizing.token_bytes(model, elem_bytes, tp)
    if model.encoder_only or pp == 1:
        return per_token
    return per_token // model.layers * math.ceil(model.layers / pp)


def fit_tp_pp(
    model: ModelSize, wbytes: int, kv_bytes: int, gpu: str, util: float, tp: int, pp: int, max_len: int
) -> NodeFit:
    """Weights split over tp x pp GPUs; what remains of gpu_memory_utilization holds the KV cache."""
    gb = sizing.GPUS[gpu]
    usable = int(gb * GB * util)
    per_gpu = math.ceil(wbytes / (tp * pp))
    free = max(0, usable - per_gpu)
    tokens = free // stage_token_bytes(model, kv_bytes, tp, pp)
    return NodeFit(gpu, gb, tp, usable, per_gpu, free, tokens, tokens / max_len, pp=pp)


def smallest_nodes(
    model: ModelSize, wbytes: int, kv_bytes: int, gpu: str, util: float, max_len: int, per_node: int
) -> Optional[NodeFit]:
    """The fewest nodes of per_node GPUs (TP = the largest valid size up to per_node, PP = the rest)
    whose KV cache holds sizing.MIN_SEQS sequences of max_len; None up to MAX_NODES."""
    tps = [t for t in sizing.TP_SIZES if t <= per_node and per_node % t == 0 and sizing.valid_tp(model, t)]
    if not tps:
        return None
    tp = tps[-1]
    for nodes in range(2, MAX_NODES + 1):
        pp = nodes * per_node // tp
        if pp > model.layers:  # a stage needs a layer
            return None
        f = fit_tp_pp(model, wbytes, kv_bytes, gpu, util, tp, pp, max_len)
        if f.max_seqs >= sizing.MIN_SEQS:
            f.nodes, f.gpus_per_node = nodes, per_node
            return f
    return None


def nodes_settings(f: NodeFit) -> str:
    """The settings of a layout over nodes, as the command line takes them."""
    return (
        f"cluster.nodes_per_task={f.nodes} cluster.gpus_per_task={f.gpus_per_node} "
        f"model.tensor_parallel_size={f.tp} model.pipeline_parallel_size={f.pp}"
    )


def node_advice(
    model: ModelSize,
    wbytes: int,
    kv_bytes: int,
    gpu: str,
    util: float,
    layout: tuple[int, int],
    max_len: int,
    per_node: int,
) -> NodeAdvice:
    """advice.advice for the configured (TP, PP), sized at TP x PP, and, when no one node of
    per_node GPUs holds the model, the fewest nodes that do (`nodes`: a NodeFit, else None)."""
    tp, pp = layout
    adv = NodeAdvice(**advice(model, wbytes, kv_bytes, gpu, util, tp, max_len), nodes=None)
    if adv["recommended_tp"] is None:
        spread = smallest_nodes(model, wbytes, kv_bytes, gpu, util, max_len, per_node)
        if spread is not None:
            adv["nodes"] = spread
            adv["layout"] = (
                f"needs more than one node: no tensor parallel size up to {per_node} (one node of {per_node} "
                f"{gpu}) holds the weights ({wbytes / GB:,.0f} GB) plus {sizing.MIN_SEQS} sequences of "
                f"max_model_len={max_len:,}; over {spread.nodes} nodes (tensor parallel inside a node, pipeline "
                f"parallel across nodes): {nodes_settings(spread)}, {spread.weights / GB:,.1f} GB of weights per "
                f"GPU, room for {sizing.seqs(spread.max_seqs)} sequences"
            )
    if pp > 1:
        adv["fit"] = fit_tp_pp(model, wbytes, kv_bytes, gpu, util, tp, pp, max_len)
        adv["warnings"] = stage_warnings(model, adv["fit"], kv_bytes, gpu, util, max_len)
    return adv


def stage_warnings(model: ModelSize, f: NodeFit, kv_bytes: int, gpu: str, util: float, max_len: int) -> list[str]:
    """What the configured TP x PP leaves too little room for, with the levers."""
    where = f"tensor_parallel_size={f.tp} x pipeline_parallel_size={f.pp}"
    if f.kv_free == 0:
        return [
            f"the weights ({f.weights / GB:.1f} GB per GPU at {where}) leave no room for a KV cache in "
            f"{f.usable / GB:.1f} GB ({gpu} x gpu_memory_utilization {util})"
        ]
    if f.max_seqs >= sizing.WARN_SEQS:
        return []
    levers = [f"a lower model.max_model_len (now {max_len:,})", "more nodes (a larger model.pipeline_parallel_size)"]
    if kv_bytes > 1 and not model.encoder_only:
        levers.insert(1, "an FP8 KV cache (quantization=kv-fp8, or quantization.kv_cache_dtype=fp8)")
    return [
        f"the KV cache holds only {sizing.seqs(f.max_seqs)} sequences of max_model_len={max_len:,} at once at "
        f"{where}: few sequences in flight, low throughput. Levers: {', '.join(levers)}"
    ]
