"""Config schemas (dataclasses, one per section, registered in Hydra's ConfigStore by config/store.py)
and the conversion of a composed config to a plain dict or the typed `Config`."""

from __future__ import annotations

import copy
import re
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

DEFAULT_ROWS_PER_SHARD = 10000


@dataclass
class InputConfig:
    path: Optional[str] = None
    format: Optional[str] = None
    id_column: Optional[str] = None
    columns: Optional[list[str]] = None
    # A column holding each row's own SamplingParams overrides ({temperature: 0.7, max_tokens: 32}).
    sampling_column: Optional[str] = None
    # Sampling keys whose config value wins over a row's own (input.sampling_column, an OpenAI
    # request's body): `redo` sets the keys its overrides name. Empty: the row's own values win.
    sampling_overridden: list[str] = field(default_factory=list)
    # A hub dataset's split (input.path=org/name); local files ignore it.
    split: str = "train"
    # A column holding each row's LoRA adapter name (a key of model.lora.adapters); null: model.lora.default.
    adapter_column: Optional[str] = None


@dataclass
class LabelsConfig:
    """Labeling: the prompt asks for one of `names`, decoding is constrained to them, `label` column."""

    names: list[str] = field(default_factory=list)
    description: Optional[str] = None
    # exp(sum of the label's token logprobs): the model's probability of the label it chose.
    confidence: bool = False


@dataclass
class PromptConfig:
    template: str = "{text}"
    template_file: Optional[str] = None
    system: Optional[str] = None
    mode: str = "chat"
    overlong: str = "error_row"
    # Few-shot turns before each row: the template filled from each example's fields, then its `answer`.
    examples: list[dict[str, Any]] = field(default_factory=list)
    # Passed to the chat template, e.g. {enable_thinking: false} for Qwen3.
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    labels: LabelsConfig = field(default_factory=LabelsConfig)
    # The column holding each row's image (a path relative to the input file, a file:// or data:
    # URL, or bytes): the chat's last user turn gets it before its text (requests/images.py).
    image_column: Optional[str] = None
    image_http: bool = False  # fetch http(s) image URLs (off: such a row is an error row)
    image_max_bytes: int = 20 << 20  # a bigger image file is its row's error row
    image_max_pixels: int = 40_000_000  # width x height above this: its row's error row


@dataclass
class TaskConfig:
    """What the engine computes per row: text (generate) or, with a pooling model, a vector, a class or a score."""

    name: str = "generate"
    # embed: keep the first N dimensions (Matryoshka models only; vLLM refuses others).
    dimensions: Optional[int] = None
    # classify: `label` is null when the top probability is below this.
    min_prob: Optional[float] = None
    # score: the two texts of a row, str.format templates over its fields.
    query: Optional[str] = None
    document: Optional[str] = None


POOLING_TASKS = ("embed", "classify", "score")


@dataclass
class LoraConfig:
    """LoRA adapters over the base model: a name -> a local PEFT adapter folder (engine/lora.py)."""

    adapters: dict[str, str] = field(default_factory=dict)
    # The adapter every row uses unless its input.adapter_column names another; None: the base model.
    default: Optional[str] = None
    # vLLM's max_loras / max_lora_rank; None: from the adapters (their count, their configs' largest r).
    max_loras: Optional[int] = None
    max_lora_rank: Optional[int] = None


@dataclass
class ModelConfig:
    path: Optional[str] = None
    revision: Optional[str] = None
    dtype: str = "auto"
    max_model_len: Optional[int] = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enforce_eager: bool = False
    gpu_memory_utilization: float = 0.9
    max_num_seqs: Optional[int] = None
    max_num_batched_tokens: Optional[int] = None
    enable_prefix_caching: Optional[bool] = None
    # KV cache block size in tokens; unset: 32 on CPU (engine/engine_args.CPU_BLOCK_SIZE), vLLM's
    # own default on GPUs (16). The prefix cache serves whole blocks only.
    block_size: Optional[int] = None
    trust_remote_code: bool = False
    seed: int = 0
    # vLLM reasoning parser (qwen3, deepseek_r1, ...): thinking goes to the `reasoning` column,
    # and structured outputs constrain only the answer after it.
    reasoning_parser: Optional[str] = None
    # JSON from structured outputs without free whitespace (xgrammar backend): small models
    # otherwise pad with whitespace until max_tokens and the JSON never closes.
    compact_json: bool = True
    # How the model folder's files are known (models/identity.py): `sampled` hashes a weight file
    # over 16 MiB by its size, first MiB and 32 blocks of 64 KiB; `full` hashes every byte (a
    # same-size change between those blocks is seen too). Not in the fingerprint: outputs are the same.
    identity: str = "sampled"
    lora: LoraConfig = field(default_factory=LoraConfig)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class QuantizationConfig:
    method: Optional[str] = None
    kv_cache_dtype: str = "auto"


@dataclass
class StructuredOutputsConfig:
    """vLLM structured outputs: the text always matches (set at most one)."""

    choice: Optional[list[str]] = None
    regex: Optional[str] = None
    json: Optional[str] = None  # a JSON schema, inline or the path of a .json file
    grammar: Optional[str] = None


@dataclass
class SamplingConfig:
    # Greedy by default: vLLM's temperature 1.0 would make a resumed shard differ.
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 256
    min_tokens: int = 0
    n: int = 1
    seed: Optional[int] = None
    # Each row its own seed, derived from sampling.seed and the row's id: reproducible per row
    # whatever the batch, shard or resume, and duplicate rows are sampled independently.
    seed_per_row: bool = False
    logprobs: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)

    @cached_property
    def params(self) -> dict[str, Any]:
        """These values by their SamplingParams names, as one dict (built once: read per row)."""
        return asdict(self)


@dataclass
class ShardingConfig:
    num_shards: Optional[int] = None
    rows_per_shard: Optional[int] = None


@dataclass
class OutputConfig:
    dir: Optional[str] = None
    format: str = "parquet"
    # A window of seconds of work (what a SIGKILL can lose at any engine speed) and a cap on the rows
    # held between commits; engine/commit_policy.py is the rule (issue 44).
    commit_every_rows: int = 20000
    commit_every_seconds: float = 5.0
    # Split the merged output into DIR/output/output-NNNNN-of-MMMMM.<ext> files of at most this many rows.
    max_rows_per_file: Optional[int] = None
    # false (the umask decides) | true = user (0700 folders, 0600 files) | group (0750/0640).
    private: Any = False
    # How locks are taken: auto (flock, or lock files where flock fails or is node-local) | flock |
    # file (lock files, for a filesystem whose flock is node-local and not detected). Not in the fingerprint.
    lock: str = "auto"
    # Earlier run directories whose answers to identical requests are taken instead of computed
    # (a path or a list of them; rundir/reuse.py). Not in the fingerprint: the same run either way.
    reuse: Any = None


@dataclass
class ClusterConfig:
    name: str = "local"
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    time: int = 60
    gpus_per_task: int = 0
    cpus_per_task: Optional[int] = None
    mem: Optional[str] = None
    constraint: Optional[str] = None
    array_parallelism: int = 64
    shards_per_task: int = 1
    # Engines (worker processes) per array task, each on its own GPUs (or cores): an int, or
    # "auto" = the task's GPUs / (tensor x pipeline parallel size). See config/engines.py.
    engines_per_task: Any = 1
    # Nodes one engine spans (config/nodes.py): the first runs the worker, the others engine ranks only.
    nodes_per_task: int = 1
    signal_lead_s: int = 120
    max_attempts: int = 3
    # vLLM's cache folder (VLLM_CACHE_ROOT) the tasks share, `~` and `$VAR` expanded in the task; None:
    # the task's VLLM_CACHE_ROOT, else ~/.cache/vllm. The first start of a model writes it under a lock
    # while the others wait at most cache_wait_s, then start on a private cache (engine/compile_cache.py).
    cache_dir: Optional[str] = None
    cache_wait_s: int = 900
    # MiB of decoded images (prompt.image_column) a worker holds made ahead of its engine: the rows
    # made ahead stop there, so a window of big pictures costs this much memory, not its rows' worth.
    image_window_mb: int = 512
    # The merge job (no GPU): minutes, memory (None: the partition's default) and CPUs. Merge streams
    # shard by shard, so its memory does not grow with the run; its time does (see benchmarks/results/merge.md).
    merge_time: int = 60
    merge_mem: Optional[str] = None
    merge_cpus: int = 1
    setup: list[str] = field(default_factory=list)
    sbatch_extra: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    # Variables of the submitting shell passed to the tasks by name (secrets: never on a command
    # line, never in a file); submit refuses when one is unset. security.secret_env.
    env_inherit: list[str] = field(default_factory=list)


@dataclass
class Config:
    input: InputConfig = field(default_factory=InputConfig)
    prompt: PromptConfig = field(default_factory=PromptConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    task: TaskConfig = field(default_factory=TaskConfig)


def escape_interpolation(value: str) -> str:
    """The string OmegaConf gives back unchanged: `${` escaped, with the backslashes before it."""
    return re.sub(r"(\\*)\$\{", lambda m: "\\" * (2 * len(m.group(1)) + 1) + "${", value)


def _literal(obj: Any) -> Any:
    if isinstance(obj, str):
        return escape_interpolation(obj) if "${" in obj else obj
    if isinstance(obj, dict):
        return {k: _literal(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_literal(v) for v in obj]
    return obj


def structured(values: dict[str, Any]) -> DictConfig:
    """A plain dict (run.yaml's `config`) checked against the schema, its strings taken literally
    (a template's `${` is text, not an interpolation); keys it lacks take their defaults."""
    return OmegaConf.merge(OmegaConf.structured(Config), _literal(values))  # type: ignore[return-value]


def to_config(cfg: Any) -> Config:
    """The typed Config of a composed DictConfig or of a plain dict (run.yaml's `config`)."""
    if isinstance(cfg, Config):
        return cfg
    return OmegaConf.to_object(cfg if isinstance(cfg, DictConfig) else structured(cfg))  # type: ignore[return-value]


def to_dict(cfg: DictConfig) -> dict[str, Any]:
    """Plain, resolved dict of a config; `${oc.env:NAME}` of a secret-named NAME stays as written
    (a task resolves it, redaction.resolve_refs): the dict is what run.yaml and the scripts hold."""
    return OmegaConf.to_container(_secret_refs_kept(cfg), resolve=True)  # type: ignore[return-value]


def _secret_refs_kept(cfg: DictConfig) -> DictConfig:
    """cfg, or a copy whose secret `${oc.env:NAME}` references are escaped (left unresolved)."""
    from batchinfer.redaction import ENV_REF, is_secret_name

    def escaped(text: str) -> str:
        def one(m: re.Match[str]) -> str:
            already = m.start() > 0 and text[m.start() - 1] == "\\"  # escaped: text already
            return m.group(0) if already or not is_secret_name(m.group(1)) else "\\" + m.group(0)

        return ENV_REF.sub(one, text)

    found: list[tuple[list[Any], str]] = []

    def walk(node: Any, path: list[Any]) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in items:
            if isinstance(v, str) and escaped(v) != v:
                found.append(([*path, k], escaped(v)))
            else:
                walk(v, [*path, k])

    walk(OmegaConf.to_container(cfg, resolve=False), [])
    if not found:
        return cfg
    out = copy.deepcopy(cfg)
    for path, value in found:
        node = out
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
    return out
