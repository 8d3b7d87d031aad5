"""Config schemas (dataclasses registered in Hydra's ConfigStore), what their types cannot check,
and the conversion of a composed config to a plain dict or the typed `Config`."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from batchinfer.errors import ConfigError


def conf_dir() -> Path:
    """The packaged conf/ (batchinfer.conf in the wheel; the repo's conf/ in a checkout)."""
    try:
        import batchinfer.conf as packaged

        return Path(packaged.__file__).resolve().parent
    except ImportError:
        return Path(__file__).resolve().parent.parent / "conf"


DEFAULT_ROWS_PER_SHARD = 10000
# Values typed in a shell that Hydra's grammar would reject or interpolate ({, [, #, ${): taken as typed.
LITERAL_KEYS = ("prompt.template", "prompt.system", "task.query", "task.document")
# The same, except that a value wholly in Hydra's quotes ('[a-z]+') keeps Hydra's meaning (the quotes
# go), as these keys had to be written before they were taken literally, and `null` unsets the key.
LITERAL_UNLESS_QUOTED_KEYS = (
    "prompt.labels.description",
    "sampling.structured_outputs.regex",
    "sampling.structured_outputs.json",
    "sampling.structured_outputs.grammar",
)
# List keys whose one-string value is one item, taken as typed (`sampling.stop=###` is ["###"]); a
# value in brackets is Hydra's list syntax (`sampling.stop=[a,b]`).
LITERAL_LIST_KEYS = ("sampling.stop",)


@dataclass
class InputConfig:
    path: Optional[str] = None
    format: Optional[str] = None
    id_column: Optional[str] = None
    columns: Optional[list[str]] = None
    # A column holding each row's own SamplingParams overrides ({temperature: 0.7, max_tokens: 32}).
    sampling_column: Optional[str] = None
    # A hub dataset's split (input.path=org/name); local files ignore it.
    split: str = "train"


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
    trust_remote_code: bool = False
    seed: int = 0
    # vLLM reasoning parser (qwen3, deepseek_r1, ...): thinking goes to the `reasoning` column,
    # and structured outputs constrain only the answer after it.
    reasoning_parser: Optional[str] = None
    # JSON from structured outputs without free whitespace (xgrammar backend): small models
    # otherwise pad with whitespace until max_tokens and the JSON never closes.
    compact_json: bool = True
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
    commit_every_rows: int = 500
    commit_every_seconds: float = 60.0
    # Split the merged output into DIR/output/output-NNNNN-of-MMMMM.<ext> files of at most this many rows.
    max_rows_per_file: Optional[int] = None
    # false (the umask decides) | true = user (0700 folders, 0600 files) | group (0750/0640).
    private: Any = False
    # How locks are taken: auto (flock, or lock files where flock fails or is node-local) | flock |
    # file (lock files, for a filesystem whose flock is node-local and not detected). Not in the fingerprint.
    lock: str = "auto"


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
    signal_lead_s: int = 120
    max_attempts: int = 3
    # The merge job (no GPU): minutes, memory (None: the partition's default) and CPUs. Merge streams
    # shard by shard, so its memory does not grow with the run; its time does (see benchmarks/results/merge.md).
    merge_time: int = 60
    merge_mem: Optional[str] = None
    merge_cpus: int = 1
    setup: list[str] = field(default_factory=list)
    sbatch_extra: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)


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


def schema_keys(key: str) -> tuple[str, list[str]]:
    """(section, its keys) for a dotted key: the schema's keys beside the key's last part."""
    import dataclasses
    import typing

    cls: Any = Config
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        hints = typing.get_type_hints(cls)
        sub = hints.get(part)
        sub = next((a for a in typing.get_args(sub) if dataclasses.is_dataclass(a)), sub)
        if not dataclasses.is_dataclass(sub):
            return ".".join(parts[: i + 1]), []
        cls = sub
    return ".".join(parts[:-1]), [f.name for f in dataclasses.fields(cls)]


def unknown_key_message(key: str) -> str:
    """One line for a key the schema does not have: the keys of its section, the closest first."""
    import difflib

    section, names = schema_keys(key)
    last = key.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(last, names, n=1)
    hint = f" (did you mean {section + '.' if section else ''}{close[0]}?)" if close else ""
    where = f"{section} keys are" if section else "top-level keys are"
    return f"{key} is not a key{hint}; {where}: {', '.join(names)}"


def unknown_keys(cfg: DictConfig) -> list[str]:
    """Keys of a composed config that its schema does not have (a `+key` typo passes Hydra)."""
    found: list[str] = []

    def walk(node: Any, prefix: str) -> None:
        _, names = schema_keys(f"{prefix}x" if prefix else "x")
        if not names:
            return  # a free-form dict (cluster.env, engine_kwargs, ...): any key
        for k in node.keys():
            key = f"{prefix}{k}"
            if k not in names:
                found.append(key)
            elif isinstance(node.get(k), DictConfig):
                walk(node.get(k), f"{key}.")

    walk(cfg, "")
    return found


def to_config(cfg: Any) -> Config:
    """The typed Config of a composed DictConfig or of a plain dict (run.yaml's `config`)."""
    if isinstance(cfg, Config):
        return cfg
    return OmegaConf.to_object(cfg if isinstance(cfg, DictConfig) else structured(cfg))  # type: ignore[return-value]


def register_configs() -> None:
    """Register the schemas so YAML in conf/ is validated against them."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="schema", node=Config)


CHOICES = {
    "prompt.mode": ("chat", "raw"),
    "prompt.overlong": ("error_row", "truncate_left", "truncate_right", "fail"),
    "output.format": ("jsonl", "parquet", "openai", "hf"),
    "output.lock": ("auto", "flock", "file"),
    "task.name": ("generate", *POOLING_TASKS),
    "input.format": (None, "jsonl", "json", "csv", "tsv", "parquet", "arrow", "hf_disk", "openai"),
}


# key -> (check, what is allowed): vLLM or Slurm would reject these later, after submitting.
RANGES: dict[str, tuple[Any, str]] = {
    "sampling.temperature": (lambda v: v >= 0, "a number >= 0 (0 is greedy)"),
    "sampling.top_p": (lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "sampling.top_k": (lambda v: v >= -1, "an integer: 0 or -1 (off), or >= 1"),
    "sampling.min_p": (lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    "sampling.max_tokens": (lambda v: v >= 1, "an integer >= 1"),
    "sampling.min_tokens": (lambda v: v >= 0, "an integer >= 0"),
    "sampling.n": (lambda v: v >= 1, "an integer >= 1"),
    "sampling.logprobs": (lambda v: v >= -1, "an integer >= 0 (-1: the whole vocabulary)"),
    "sampling.presence_penalty": (lambda v: -2 <= v <= 2, "a number in [-2, 2]"),
    "sampling.frequency_penalty": (lambda v: -2 <= v <= 2, "a number in [-2, 2]"),
    "sampling.repetition_penalty": (lambda v: v > 0, "a number > 0 (1 is off)"),
    "model.gpu_memory_utilization": (lambda v: 0 < v <= 1, "a fraction in (0, 1]"),
    "model.max_model_len": (lambda v: v >= 1, "an integer >= 1"),
    "model.tensor_parallel_size": (lambda v: v >= 1, "an integer >= 1"),
    "model.pipeline_parallel_size": (lambda v: v >= 1, "an integer >= 1"),
    "model.max_num_seqs": (lambda v: v >= 1, "an integer >= 1"),
    "model.max_num_batched_tokens": (lambda v: v >= 1, "an integer >= 1"),
    "sharding.num_shards": (lambda v: v >= 1, "an integer >= 1"),
    "sharding.rows_per_shard": (lambda v: v >= 1, "an integer >= 1"),
    "output.commit_every_rows": (lambda v: v >= 1, "an integer >= 1"),
    "output.commit_every_seconds": (lambda v: v > 0, "a number of seconds > 0"),
    "output.max_rows_per_file": (lambda v: v >= 1, "an integer >= 1"),
    "cluster.time": (lambda v: v >= 1, "an integer number of minutes >= 1"),
    "cluster.gpus_per_task": (lambda v: v >= 0, "an integer >= 0"),
    "cluster.cpus_per_task": (lambda v: v >= 1, "an integer >= 1"),
    "cluster.array_parallelism": (lambda v: v >= 1, "an integer >= 1"),
    "cluster.shards_per_task": (lambda v: v >= 1, "an integer >= 1"),
    "cluster.signal_lead_s": (lambda v: v >= 0, "an integer number of seconds >= 0"),
    "cluster.max_attempts": (lambda v: v >= 1, "an integer >= 1"),
    "cluster.merge_time": (lambda v: v >= 1, "an integer number of minutes >= 1"),
    "cluster.merge_cpus": (lambda v: v >= 1, "an integer >= 1"),
    "task.dimensions": (lambda v: v >= 1, "an integer >= 1"),
    "task.min_prob": (lambda v: 0 <= v <= 1, "a probability in [0, 1]"),
}


def validate(cfg: DictConfig) -> None:
    """Check values the schema's types cannot: choices, ranges, exclusive keys."""
    for key, allowed in CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in allowed:
            shown = ", ".join(a for a in allowed if a)
            raise ConfigError(f"{key}={value!r} is not one of: {shown}")
    sh = cfg.sharding
    if sh.num_shards is not None and sh.rows_per_shard is not None:
        raise ConfigError("set sharding.num_shards or sharding.rows_per_shard, not both")
    for key, (ok, allowed) in RANGES.items():
        value = OmegaConf.select(cfg, key)
        if value is not None and not ok(value):
            raise ConfigError(f"{key}={value} is out of range: it takes {allowed}")
    if cfg.sampling.min_tokens > cfg.sampling.max_tokens:
        raise ConfigError(
            f"sampling.min_tokens={cfg.sampling.min_tokens} is out of range: it takes at most "
            f"sampling.max_tokens={cfg.sampling.max_tokens}"
        )
    so = [k for k in ("choice", "regex", "json", "grammar") if cfg.sampling.structured_outputs[k] is not None]
    if len(so) > 1:
        raise ConfigError(f"sampling.structured_outputs: set one of choice, regex, json, grammar (got {', '.join(so)})")
    labels = cfg.prompt.labels.names
    if labels and so and so != ["choice"]:
        raise ConfigError(f"prompt.labels.names sets the choice constraint; unset sampling.structured_outputs.{so[0]}")
    if labels and len(set(labels)) != len(labels):
        raise ConfigError(f"prompt.labels.names has duplicates: {list(labels)}")
    _check_task(cfg.task)
    _check_dropped_settings(cfg)
    _check_vllm_names(cfg)
    check_output_format(cfg.task.name, cfg.output.format, cfg.input.format)
    from batchinfer.config.json_schema import check_json_schema

    check_json_schema(cfg.sampling.structured_outputs.json)
    from batchinfer.config.engines import check_engines_value

    check_engines_value(cfg.cluster.engines_per_task)
    if cfg.sampling.seed_per_row and cfg.sampling.seed is None:
        raise ConfigError("sampling.seed_per_row=true needs sampling.seed (the base the row seeds derive from)")
    from batchinfer.security import check_config_secrets, private_mode

    private_mode(cfg.output.private)
    check_config_secrets(to_dict(cfg))


def _check_dropped_settings(cfg: DictConfig) -> None:
    """Settings a run would ignore are refused: the user meant them to change the answers."""
    p, task = cfg.prompt, cfg.task.name
    if task == "generate" and p.mode == "raw":
        dropped = [k for k, v in (("prompt.system", p.system), ("prompt.examples", p.examples)) if v]
        dropped += ["prompt.labels"] if p.labels.names else []
        if dropped:
            raise ConfigError(
                f"prompt.mode=raw sends the filled template alone, without chat turns: {', '.join(dropped)} "
                "would be dropped; use prompt.mode=chat, or unset them"
            )
    if task in POOLING_TASKS:
        so = [k for k in ("choice", "regex", "json", "grammar") if cfg.sampling.structured_outputs[k] is not None]
        dropped = [f"sampling.structured_outputs.{so[0]}"] if so else []
        dropped += ["prompt.labels"] if p.labels.names else []
        dropped += [f"sampling.n={cfg.sampling.n}"] if cfg.sampling.n > 1 else []
        if dropped:
            raise ConfigError(
                f"task={task} computes one vector, class or score per row and samples no text: "
                f"{', '.join(dropped)} would be ignored; unset it (they are settings of task=generate)"
            )


def _check_vllm_names(cfg: DictConfig) -> None:
    """Names and limits vLLM refuses at engine start, after the job waited in the queue."""
    import difflib

    from batchinfer.config import vllm_names as names

    m, q = cfg.model, cfg.quantization
    kwargs = m.engine_kwargs or {}
    checked = [
        ("model.dtype", m.dtype, names.MODEL_DTYPES),
        ("quantization.method", q.method, names.QUANTIZATION_METHODS),
        ("quantization.kv_cache_dtype", q.kv_cache_dtype, names.KV_CACHE_DTYPES),
    ]
    if "reasoning_parser_plugin" not in kwargs:  # a plugin registers parsers of its own names
        checked.append(("model.reasoning_parser", m.reasoning_parser, names.REASONING_PARSERS))
    for key, value, allowed in checked:
        if value is None or value in allowed:
            continue
        close = difflib.get_close_matches(str(value), allowed, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(f"{key}={value!r} is not a name vLLM knows{hint}; it takes one of: {', '.join(allowed)}")
    cap, asked = kwargs.get("max_logprobs", names.MAX_LOGPROBS), cfg.sampling.logprobs
    if asked is not None and cap != -1 and (asked == -1 or asked > cap):
        what = "the whole vocabulary" if asked == -1 else f"{asked} log probabilities per token"
        raise ConfigError(
            f"sampling.logprobs={asked} asks for {what}, above vLLM's limit of {cap} (max_logprobs): "
            f"lower sampling.logprobs, or raise the limit with model.engine_kwargs.max_logprobs={asked}"
        )


def check_output_format(task: str, output_format: str, input_format: Optional[str], source: str = "") -> None:
    """output.format=openai writes OpenAI Batch responses: chat or completion texts, or embeddings of
    /v1/embeddings requests; other pooling rows have no such form (merge would fail on them).
    source: why the output is openai when the user did not ask (an OpenAI Batch input)."""
    if output_format != "openai" or task not in POOLING_TASKS:
        return
    if task == "embed" and input_format == "openai":
        return
    if source:
        raise ConfigError(
            f"{source} is an OpenAI Batch file, answered in the OpenAI Batch output format, which task={task} "
            "rows have no form for: its chat and completion lines run with task=generate, its /v1/embeddings "
            "lines with task=embed"
        )
    embed = (
        " (task=embed writes them for OpenAI Batch /v1/embeddings requests: set input.format=openai)"
        if task == "embed"
        else ""
    )
    raise ConfigError(
        f"output.format=openai writes OpenAI Batch responses, which task={task} rows are not{embed}; "
        "choose output.format=parquet, jsonl or hf"
    )


def _check_task(task: DictConfig) -> None:
    """Each task.* key belongs to one task; score needs both of its texts."""
    owner = {"dimensions": "embed", "min_prob": "classify", "query": "score", "document": "score"}
    for key, name in owner.items():
        if task[key] is not None and task.name != name:
            raise ConfigError(f"task.{key} is a setting of task={name}; this run has task={task.name}")
    if task.name == "score" and (task.query is None or task.document is None):
        raise ConfigError(
            "task=score needs two texts per row: task.query and task.document, templates over the row's "
            "fields, e.g. task.query={question} task.document={passage}"
        )


def check_sampling_column(column: Optional[str], columns: list[str], source: Optional[str]) -> None:
    """input.sampling_column must name a column of the input: a misspelt one would run every row
    with the config's sampling, silently."""
    if column is None or column in columns:
        return
    import difflib

    close = difflib.get_close_matches(column, columns, n=1)
    hint = f" (did you mean input.sampling_column={close[0]}?)" if close else ""
    raise ConfigError(
        f"input.sampling_column={column!r} is not a column of {source}{hint}; its columns are: "
        f"{', '.join(columns)}. Name the column that holds each row's sampling values, or unset it"
    )


def to_dict(cfg: DictConfig) -> dict[str, Any]:
    """Plain, resolved dict of a config."""
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
