"""The records of `batchinfer plan` (`plan --json` prints them): plan.py makes them, plan_text.py
words them."""

from __future__ import annotations

from typing import NotRequired, Optional, TypedDict


class InputSection(TypedDict):
    """Input rows, shards and array tasks."""

    path: str
    files: int
    format: Optional[str]
    rows: int
    shards: int
    max_rows_per_shard: int
    shards_per_task: int
    array_tasks: int


class PromptTokens(TypedDict):
    """Prompt tokens of the sampled rows, counted as vLLM would; the lengths only when a row counted."""

    mode: str
    task: str
    sampled_rows: int
    tokenized_rows: int
    row_errors: int
    first_row_error: Optional[str]
    output_upper_bound: int  # a pooling model generates nothing: 0
    max_tokens: int
    n: int
    mean: NotRequired[float]
    p50: NotRequired[int]
    p95: NotRequired[int]
    max: NotRequired[int]
    estimated_total: NotRequired[int]
    at_or_over_max_model_len: NotRequired[int]


class ModelSection(TypedDict):
    """Parameters, weight bytes and KV (an encoder-only model: activation) bytes per token."""

    path: str
    folder: str
    architecture: Optional[str]
    task: str
    params: int
    params_source: str
    layers: int
    kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    quantization: Optional[str]
    checkpoint_quantized: bool
    weight_bytes_per_param: float
    weight_bytes: int  # lora_bytes included
    lora_bytes: int  # LoRA adapter slots (model.lora): max_loras x max_lora_rank; 0 without adapters
    kv_cache: bool
    kv_cache_dtype: str
    kv_bytes_per_element: int
    kv_bytes_per_token: int
    activation_bytes_per_token: Optional[int]
    max_model_len: int
    kv_bytes_per_sequence: int
    max_num_batched_tokens: Optional[int]
    vision: NotRequired[Optional[VisionSection]]  # a vision-language model's encoder (None: a text model)


class VisionSection(TypedDict):
    """A vision-language model's vision encoder (models/vision_sizing.py) and one image's cost."""

    layers: int
    hidden_size: int
    patch_size: int
    image_size: int
    params: int  # in the model's params and weight bytes
    max_image_tokens: Optional[int]  # prompt tokens of the largest image the processor makes
    embedded_tokens: Optional[int]  # of those, image embeddings (what the encoder cache holds)
    encoder_cache_bytes_per_image: Optional[int]
    image_tokens: str  # how an image's tokens are counted (models/image_tokens.py)


class NodesLayout(TypedDict):
    """The layout over nodes proposed when one node does not hold the model."""

    nodes_per_task: int
    gpus_per_node: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    weight_bytes_per_gpu: int
    max_seqs_at_max_model_len: float
    settings: str


class GpuRow(TypedDict):
    """One GPU preset's sizing: memory per GPU at TP x PP, KV tokens, concurrency, layout, warnings."""

    gpu: str
    gpu_gb: float
    gpu_memory_utilization: float
    tensor_parallel_size: int
    pipeline_parallel_size: int
    nodes_per_task: int
    usable_bytes: int
    weight_bytes_per_gpu: int
    kv_cache_bytes_per_gpu: int
    kv_tokens: int
    activation_bytes_per_gpu: Optional[int]  # encoder-only: the memory after the weights holds a batch
    batch_tokens_fit: Optional[int]
    max_num_batched_tokens: int
    max_seqs_at_max_model_len: float
    seqs_at_corpus_length: Optional[float]
    recommended_tp: Optional[int]
    recommended_nodes: Optional[NodesLayout]
    layout: str
    warnings: list[str]


class EnginesSection(TypedDict):
    """Engines per array task, the GPUs or cores of each, idle GPUs, shards per engine; `problem`:
    what submit would refuse."""

    setting: object  # cluster.engines_per_task as configured: an int or "auto"
    engines_per_task: Optional[int]
    gpus_per_task: int
    gpus_per_engine: int
    idle_gpus: Optional[int]
    cpus_per_task: Optional[int]
    cpus_per_engine: Optional[int]
    shards_per_task: int
    shards_per_engine: Optional[float]
    engines_without_shards: Optional[int]
    problem: Optional[str]
    nodes: NotRequired[str]  # an engine over several nodes (cluster.nodes_per_task)


class PlanReport(TypedDict):
    """The whole plan (plan.estimate)."""

    input: Optional[InputSection]  # None: input.path unset, sizing only
    prompt_tokens: Optional[PromptTokens]
    model: ModelSection
    notes: list[str]
    gpus: list[GpuRow]
    engines: EnginesSection
