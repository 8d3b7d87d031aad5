"""Weights and KV-cache arithmetic from a model's config.json: what fits on which GPU, and how to lay it out.

Units: GPU memory is the vendor's label in decimal GB (10^9 bytes), as are weights and free memory;
KV per token is given in KiB and per sequence also in GiB (2^30), the units vLLM's logs use. The
labels understate the cards a little (an "80 GB" H100 reports 81,559 MiB = 85.5e9 bytes), which
leaves some of the room vLLM's activations and CUDA graphs take out of gpu_memory_utilization.
Encoder-only pooling models (BERT-style embedders and classifiers) have no KV cache in vLLM: for
them the memory after the weights bounds the tokens of one batch, at activation_bytes_per_token.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from batchinfer.errors import ConfigError

GB = 10**9
GIB = 2**30
# Vendor labels, decimal GB; `--gpu` matches a prefix of the name (h100, a100-40gb, ...).
GPUS = {
    "H100-80GB": 80,
    "H200-141GB": 141,
    "A100-40GB": 40,
    "A100-80GB": 80,
    "L40S-48GB": 48,
    "B200-180GB": 180,
}
DEFAULT_GPU = "H100-80GB"
TP_SIZES = (1, 2, 4, 8)
# A layout "fits" when, after the weights, the KV cache holds this many sequences of max_model_len:
# fewer and the engine batches too little to be worth a GPU.
MIN_SEQS = 4
WARN_SEQS = 10  # below this (single digits) the plan names the levers
THROUGHPUT_NOTE = "measured on an 8-GPU H100 node for an 8B model: 1.9x to 5.2x more total throughput"
DTYPE_BYTES = {"bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2, "float32": 4, "float": 4, "fp32": 4}
# Weight bytes per parameter of on-the-fly (quantization.method) and checkpoint methods.
METHOD_BYTES = {"fp8": 1, "fbgemm_fp8": 1, "ptpc_fp8": 1, "awq": 0.5, "awq_marlin": 0.5, "gptq": 0.5}
METHOD_BYTES |= {"gptq_marlin": 0.5, "bitsandbytes": 0.5, "mxfp4": 0.5, "modelopt_fp4": 0.5}
SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4}
SAFETENSORS_BYTES |= {"I16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E8M0": 1, "U32": 4}
# Integer tensors of an unquantized checkpoint are buffers (BERT's position_ids), not parameters.
INTEGER_DTYPES = {"I64", "I32", "I16", "I8", "U8", "U32", "BOOL"}
# BERT-style encoders (vLLM's bert, roberta, bert_with_rope, modernbert model files): bidirectional
# attention over the whole input in one step, so vLLM gives them no KV cache (EncoderOnlyAttentionSpec
# needs 0 bytes). Decoder-based embedders (Qwen3-Embedding, e5-mistral) keep theirs.
ENCODER_TYPES = {"bert", "roberta", "xlm-roberta", "modernbert", "nomic_bert", "new", "distilbert", "electra"}
ENCODER_TYPES |= {"mpnet", "deberta", "deberta-v2", "camembert"}
ENCODER_ARCHS = ("Bert", "Roberta", "XLMRoberta", "ModernBert", "NomicBert", "Gte", "BgeM3", "DistilBert")
ENCODER_ARCHS += ("Electra", "MPNet", "Deberta", "Camembert")
# vLLM's default max_num_batched_tokens for LLM(): 16,384 on cards of 70 GB+ (not A100), else 8,192.
DEFAULT_BATCH_TOKENS_LARGE, DEFAULT_BATCH_TOKENS = 16384, 8192


@dataclass
class ModelSize:
    """What sizing needs of a model: its shape, parameter count and checkpoint quantization."""

    layers: int
    kv_heads: int
    head_dim: int
    heads: int
    max_position: Optional[int]
    params: int
    params_source: str
    quant_method: Optional[str] = None  # declared by the checkpoint (config.json quantization_config)
    quant_bits: Optional[float] = None
    stored_bytes: Optional[int] = None  # tensor bytes in the local safetensors files
    kv_latent: Optional[int] = None  # MLA (DeepSeek): one compressed KV vector per layer
    encoder_only: bool = False  # no KV cache in vLLM: memory after the weights goes to activations
    hidden: int = 0
    intermediate: int = 0
    architecture: Optional[str] = None


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a config.json (multimodal configs nest it as text_config)."""
    return {**cfg, **cfg["text_config"]} if isinstance(cfg.get("text_config"), dict) else cfg


def is_bert_family(cfg: dict[str, Any]) -> bool:
    """A BERT-style encoder (BERT, RoBERTa, XLM-R, MiniLM, ModernBERT, ...) by model_type or architecture."""
    c = text_config(cfg)
    archs = c.get("architectures") or []
    return c.get("model_type") in ENCODER_TYPES or any(str(a).startswith(ENCODER_ARCHS) for a in archs)


def is_encoder_only(cfg: dict[str, Any]) -> bool:
    """Bidirectional attention, so vLLM keeps no KV cache: a BERT-style encoder, or a decoder made
    bidirectional (is_causal false, use_bidirectional_attention true), as vLLM's attn_type decides."""
    c = text_config(cfg)
    return is_bert_family(c) or c.get("is_causal") is False or c.get("use_bidirectional_attention") is True


def bert_params(cfg: dict[str, Any]) -> int:
    """Parameters of a BERT-style encoder: embeddings (word, absolute position, token type, LayerNorm),
    layers of 4 h^2 + 2 h x intermediate + biases and LayerNorms (9 h + intermediate), and the head:
    BERT's pooler (h^2 + h) with a classifier (h x labels + labels), RoBERTa's dense + out_proj."""
    c = text_config(cfg)
    h, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    absolute = c.get("position_embedding_type", "absolute") == "absolute" and "rotary_emb_base" not in c
    positions = c.get("max_position_embeddings", 0) if absolute else 0
    embed = (c["vocab_size"] + positions + (c.get("type_vocab_size") or 0)) * h + 2 * h
    layer = 4 * h * h + 2 * h * inter + 9 * h + inter
    arch = str((c.get("architectures") or [""])[0])
    head = h * h + h  # BertModel's pooler, also in RoBERTa/XLM-R Model checkpoints
    if arch.endswith("ForSequenceClassification"):
        labels = len(c.get("id2label") or {}) or c.get("num_labels") or 2
        head += h * labels + labels  # pooler + classifier; RoBERTa: dense + out_proj, the same count
    return embed + layers * layer + head


def config_params(cfg: dict[str, Any]) -> int:
    """Parameters from config.json: a BERT-style encoder's (bert_params), else a Llama-style decoder's:
    embeddings, attention, MLP (or experts), norms, lm_head."""
    c = text_config(cfg)
    if is_bert_family(c):
        return bert_params(c)
    hidden, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    heads = c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    attn = hidden * q + 2 * hidden * kv + q * hidden
    if c.get("attention_bias") or c.get("model_type") == "qwen2":  # Qwen2 has q/k/v biases without saying so
        attn += q + 2 * kv
    experts = c.get("num_local_experts") or c.get("num_experts") or 0
    if experts:
        inter = c.get("moe_intermediate_size") or c["intermediate_size"]
        mlp = experts * 3 * hidden * inter + hidden * experts  # experts + router
        shared = c.get("shared_expert_intermediate_size") or 0
        mlp += 3 * hidden * shared
    else:
        mlp = 3 * hidden * c["intermediate_size"]  # gate, up, down
    norms = 2 * hidden + (2 * head_dim if c.get("model_type", "").startswith("qwen3") else 0)
    embed = vocab * hidden
    lm_head = 0 if c.get("tie_word_embeddings", False) else vocab * hidden
    return embed + layers * (attn + mlp + norms) + hidden + lm_head


def checkpoint_quant(cfg: dict[str, Any]) -> tuple[Optional[str], Optional[float]]:
    """The quantization method and weight bits a pre-quantized checkpoint declares, if any."""
    qc = cfg.get("quantization_config") or text_config(cfg).get("quantization_config")
    if not isinstance(qc, dict):
        return None, None
    method = str(qc.get("quant_method") or qc.get("quant_algo") or "unknown").lower()
    bits = qc.get("bits") or qc.get("w_bit") or qc.get("weight_bits")
    for group in (qc.get("config_groups") or {}).values():  # compressed-tensors
        bits = bits or (group.get("weights") or {}).get("num_bits")
    if bits is None and method == "bitsandbytes":
        bits = 4 if qc.get("load_in_4bit") else 8
    if bits is None and ("fp8" in method or str(qc.get("quant_algo", "")).upper() == "FP8"):
        bits = 8
    if bits is None and any(s in method for s in ("fp4", "mxfp4", "awq", "gptq")):
        bits = 4
    return method, float(bits) if bits else None


def safetensors_header(path: Path) -> dict[str, Any]:
    """A .safetensors file's JSON header (8-byte length, then JSON): tensor dtypes and shapes, no data read."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def local_weights(folder: Path) -> Optional[tuple[int, int]]:
    """(floating-point elements, bytes) of the local safetensors tensors, or None when the files are not all here."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / n for n in names]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files or not all(f.is_file() for f in files):
        return None
    elements = stored = 0
    for f in files:
        for name, t in safetensors_header(f).items():
            if name == "__metadata__":
                continue
            n = math.prod(t["shape"])
            elements += 0 if t["dtype"] in INTEGER_DTYPES else n
            stored += n * SAFETENSORS_BYTES.get(t["dtype"], 2)
    return elements, stored


def read_model(folder: Path) -> ModelSize:
    """Shape and size of the model in folder: exact from safetensors headers when present, else from config.json."""
    cfg_file = folder / "config.json"
    try:
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
        c = text_config(cfg)
        heads = c["num_attention_heads"]
        kv_heads = c.get("num_key_value_heads") or heads
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        layers = c["num_hidden_layers"]
        computed = config_params(cfg)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{cfg_file}: cannot size the model from it ({type(e).__name__}: {e})") from None
    method, bits = checkpoint_quant(cfg)
    params, source, stored = computed, "config.json", None
    weights = local_weights(folder)
    if weights:
        stored = weights[1]
        if method is None:  # packed int4 tensors would undercount parameters
            params, source = weights[0], "safetensors headers"
    elif (folder / "model.safetensors.index.json").is_file() and method is None:
        total = json.loads((folder / "model.safetensors.index.json").read_text()).get("metadata", {}).get("total_size")
        if total:
            params, source = (
                int(total // DTYPE_BYTES.get(str(c.get("torch_dtype") or c.get("dtype")), 2)),
                "safetensors index",
            )
    latent = c["kv_lora_rank"] + c.get("qk_rope_head_dim", 0) if c.get("kv_lora_rank") else None
    return ModelSize(
        layers,
        kv_heads,
        head_dim,
        heads,
        c.get("max_position_embeddings"),
        params,
        source,
        method,
        bits,
        stored,
        latent,
        is_encoder_only(c),
        c["hidden_size"],
        c.get("intermediate_size") or 4 * c["hidden_size"],
        str((c.get("architectures") or [c.get("model_type", "?")])[0]),
    )


def weight_bytes_per_param(model: ModelSize, method: Optional[str], dtype: str) -> float:
    """Bytes per parameter: the checkpoint's own quantization, else quantization.method, else model.dtype."""
    if model.quant_method:
        return (model.quant_bits or 16) / 8
    if method:
        if method not in METHOD_BYTES:
            raise ConfigError(f"quantization.method={method!r}: unknown to the planner ({', '.join(METHOD_BYTES)})")
        return METHOD_BYTES[method]
    return DTYPE_BYTES.get(dtype, 2)  # "auto": 16-bit, as vLLM loads float32 checkpoints too


def weight_bytes(model: ModelSize, method: Optional[str], dtype: str) -> int:
    """Bytes of weights on the GPUs (the stored bytes of a local pre-quantized checkpoint, else params x bytes)."""
    if model.quant_method and model.stored_bytes:
        return model.stored_bytes
    return int(model.params * weight_bytes_per_param(model, method, dtype))


def kv_dtype_bytes(kv_cache_dtype: str, dtype: str) -> int:
    """Bytes per KV element: fp8* caches 1, else the model's activation dtype."""
    if kv_cache_dtype.startswith("fp8"):
        return 1
    if kv_cache_dtype != "auto":
        return DTYPE_BYTES.get(kv_cache_dtype, 2)
    return DTYPE_BYTES.get(dtype, 2) if dtype != "auto" else 2


def kv_bytes_per_token(model: ModelSize, kv_bytes: int, tp: int = 1) -> int:
    """KV cache bytes per token (on one GPU of tp): 2 (K and V) x layers x kv_heads x head_dim x bytes."""
    if model.kv_latent:
        return model.layers * model.kv_latent * kv_bytes  # MLA: one latent per layer, replicated over TP
    heads_per_gpu = max(1, math.ceil(model.kv_heads / tp))  # tp > kv_heads replicates heads
    return 2 * model.layers * heads_per_gpu * model.head_dim * kv_bytes


def activation_bytes_per_token(model: ModelSize, act_bytes: int) -> int:
    """An encoder's activation memory per token in a batch: (4 x hidden + 2 x intermediate) x bytes.

    The tensors alive at once inside one layer, rounded up: the residual stream and the fused QKV
    projection (4 h), the MLP's up-projection and its activation (2 x intermediate). Inference frees a
    layer's activations before the next layer runs, so the count does not grow with the layers; vLLM's
    attention kernels never hold a seq x seq score matrix."""
    return (4 * model.hidden + 2 * model.intermediate) * act_bytes


def token_bytes(model: ModelSize, elem_bytes: int, tp: int = 1) -> int:
    """Memory per token that bounds a batch: KV cache for decoders, activations for encoder-only models."""
    if model.encoder_only:
        return activation_bytes_per_token(model, elem_bytes)
    return kv_bytes_per_token(model, elem_bytes, tp)


def default_batch_tokens(gpu: str) -> int:
    """vLLM's max_num_batched_tokens for LLM() on this card when model.max_num_batched_tokens is unset."""
    return DEFAULT_BATCH_TOKENS_LARGE if GPUS[gpu] >= 70 and not gpu.startswith("A100") else DEFAULT_BATCH_TOKENS


@dataclass
class Fit:
    """One layout on one GPU type: memory per GPU and what the KV cache holds."""

    gpu: str
    gpu_gb: float
    tp: int
    usable: int  # bytes per GPU under gpu_memory_utilization
    weights: int  # bytes per GPU
    kv_free: int  # bytes per GPU left for the KV cache (an encoder-only model: for activations)
    kv_tokens: int  # tokens the KV cache holds (an encoder-only model: tokens per batch that fit)
    max_seqs: float  # sequences of max_model_len the KV cache holds at once (encoder: in one batch)


def fit(model: ModelSize, wbytes: int, kv_bytes: int, gpu: str, util: float, tp: int, max_len: int) -> Fit:
    """Weights split over tp GPUs; what remains of gpu_memory_utilization holds the KV cache (an
    encoder-only model's activations: kv_bytes is then the activation dtype's bytes)."""
    gb = GPUS[gpu]
    usable = int(gb * GB * util)
    per_gpu = math.ceil(wbytes / tp)
    free = max(0, usable - per_gpu)
    tokens = free // token_bytes(model, kv_bytes, tp)
    return Fit(gpu, gb, tp, usable, per_gpu, free, tokens, tokens / max_len)


def kv_tokens_per_sequence(max_len: int, block_size: int) -> int:
    """KV-cache tokens one sequence of max_len holds: vLLM allocates whole blocks of block_size tokens."""
    return -(-max_len // block_size) * block_size


def valid_tp(model: ModelSize, tp: int) -> bool:
    """vLLM needs the attention heads to divide evenly over the GPUs."""
    return model.heads % tp == 0


def smallest_fit(model: ModelSize, wbytes: int, kv_bytes: int, gpu: str, util: float, max_len: int) -> Optional[Fit]:
    """The smallest tensor parallel size whose KV cache holds MIN_SEQS sequences of max_model_len."""
    for tp in TP_SIZES:
        if valid_tp(model, tp):
            f = fit(model, wbytes, kv_bytes, gpu, util, tp, max_len)
            if f.max_seqs >= MIN_SEQS:
                return f
    return None


def seqs(x: float) -> str:
    """A sequence count for people: one decimal below 10, whole numbers above."""
    return f"{x:,.1f}" if x < 10 else f"{x:,.0f}"


def gpu_names(choice: str) -> list[str]:
    """`--gpu` value -> preset names: `all`, an exact name, or an unambiguous prefix (h100, a100-80)."""
    if choice.lower() == "all":
        return list(GPUS)
    key = "".join(ch for ch in choice.lower() if ch.isalnum())
    norm = {name: "".join(ch for ch in name.lower() if ch.isalnum()) for name in GPUS}
    hits = [n for n, k in norm.items() if k == key] or [n for n, k in norm.items() if k.startswith(key)]
    if len(hits) != 1:
        why = "is ambiguous" if hits else "is not a GPU preset"
        raise ConfigError(f"--gpu {choice} {why}; choose one of: {', '.join(GPUS)}, all")
    return hits
