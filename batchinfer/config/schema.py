"""Config schemas (registered in Hydra's ConfigStore), composition and the fingerprint."""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
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
# Values typed in a shell that Hydra's grammar would reject or interpolate ({ and ${).
LITERAL_KEYS = ("prompt.template", "prompt.system")


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
    signal_lead_s: int = 120
    max_attempts: int = 3
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


def register_configs() -> None:
    """Register the schemas so YAML in conf/ is validated against them."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="schema", node=Config)


def hydra_literal(value: str) -> str:
    """Quote a raw string so Hydra's grammar and OmegaConf give it back unchanged."""
    value = re.sub(r"(\\*)\$\{", lambda m: "\\" * (2 * len(m.group(1)) + 1) + "${", value)
    value = re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, value)
    return "'" + value.replace("'", "\\'") + "'"


def quote_literals(overrides: list[str]) -> list[str]:
    """Pass prompt.template / prompt.system through Hydra literally, as typed in the shell."""
    out = []
    for ov in overrides:
        key, sep, value = ov.partition("=")
        if sep and key.lstrip("+~") in LITERAL_KEYS:
            ov = f"{key}={hydra_literal(value)}"
        out.append(ov)
    return out


def compose(overrides: list[str], config_dir: Optional[str] = None) -> DictConfig:
    """Compose conf/config.yaml with Hydra overrides; errors name the bad key."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    register_configs()
    overrides = quote_literals(list(overrides))
    if config_dir:
        cdir = Path(config_dir).expanduser().resolve()
        if not cdir.exists():
            raise ConfigError(f"--config-dir {config_dir}: no such directory (resolved to {cdir})")
        if not cdir.is_dir():
            raise ConfigError(f"--config-dir {config_dir}: not a directory (resolved to {cdir})")
        if not os.access(cdir, os.R_OK | os.X_OK):
            raise ConfigError(f"--config-dir {config_dir}: not readable (permission denied)")
        overrides.append(f"hydra.searchpath=[{hydra_literal(f'file://{cdir}')}]")  # any folder name
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
            cfg = hydra_compose(config_name="config", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(_override_error(e)) from None
    finally:
        GlobalHydra.instance().clear()
    validate(cfg)
    return cfg


def _first_lines(msg: str) -> str:
    # Hydra appends a long "Set the environment variable HYDRA_FULL_ERROR" tail.
    lines = [ln for ln in msg.splitlines() if ln.strip() and "HYDRA_FULL_ERROR" not in ln]
    return "\n".join(lines[:4])


def _override_error(e: Exception) -> str:
    """Hydra's "Error merging override k=v" names neither the type nor the range: add both."""
    from omegaconf.errors import ValidationError

    cause = e.__cause__
    key = getattr(cause, "full_key", None)
    if not isinstance(cause, ValidationError) or not key:
        return _first_lines(str(e))
    reason = str(cause).splitlines()[0]
    allowed = _RANGES.get(key)
    return f"{key}: {reason}" + (f"; {key} takes {allowed[1]}" if allowed else "")


_CHOICES = {
    "prompt.mode": ("chat", "raw"),
    "prompt.overlong": ("error_row", "truncate_left", "truncate_right", "fail"),
    "output.format": ("jsonl", "parquet", "openai", "hf"),
    "output.lock": ("auto", "flock", "file"),
    "input.format": (None, "jsonl", "json", "csv", "tsv", "parquet", "arrow", "hf_disk", "openai"),
}


# key -> (check, what is allowed): vLLM or Slurm would reject these later, after submitting.
_RANGES: dict[str, tuple[Any, str]] = {
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
}


def validate(cfg: DictConfig) -> None:
    """Check values the schema's types cannot: choices, ranges, exclusive keys."""
    for key, allowed in _CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in allowed:
            shown = ", ".join(a for a in allowed if a)
            raise ConfigError(f"{key}={value!r} is not one of: {shown}")
    sh = cfg.sharding
    if sh.num_shards is not None and sh.rows_per_shard is not None:
        raise ConfigError("set sharding.num_shards or sharding.rows_per_shard, not both")
    for key, (ok, allowed) in _RANGES.items():
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
    if cfg.sampling.seed_per_row and cfg.sampling.seed is None:
        raise ConfigError("sampling.seed_per_row=true needs sampling.seed (the base the row seeds derive from)")
    from batchinfer.security import check_config_secrets, private_mode

    private_mode(cfg.output.private)
    check_config_secrets(to_dict(cfg))


def require_run_keys(cfg: DictConfig, input_required: bool = True) -> None:
    """The keys a run cannot start without."""
    if input_required and not cfg.input.path:
        raise ConfigError("input.path is not set: add input.path=/path/to/corpus.jsonl")
    if not cfg.model.path:
        raise ConfigError("model.path is not set: add model.path=/path/to/hf-model-folder or a preset")


def to_dict(cfg: DictConfig) -> dict[str, Any]:
    """Plain, resolved dict of a config."""
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]


# engine_kwargs that change speed or memory, not what greedy decoding generates: a run may be
# reopened or resumed with other values. speculative_config is one (the speculative=ngram preset
# keeps greedy outputs; with temperature > 0 the samples differ, as a changed batch can make
# them). Every other engine_kwargs key is part of the fingerprint. Listed in DESIGN.md.
THROUGHPUT_ENGINE_KWARGS = frozenset(
    {
        "max_num_seqs",
        "speculative_config",
        "max_num_batched_tokens",
        "gpu_memory_utilization",
        "kv_cache_memory_bytes",
        "num_gpu_blocks_override",
        "swap_space",
        "cpu_offload_gb",
        "block_size",
        "enforce_eager",
        "compilation_config",
        "cuda_graph_sizes",
        "max_seq_len_to_capture",
        "enable_chunked_prefill",
        "long_prefill_token_threshold",
        "max_num_partial_prefills",
        "max_long_partial_prefills",
        "enable_prefix_caching",
        "prefix_caching_hash_algo",
        "async_scheduling",
        "scheduling_policy",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "data_parallel_size",
        "distributed_executor_backend",
        "disable_custom_all_reduce",
        "max_parallel_loading_workers",
        "download_dir",
        "safetensors_load_strategy",
        "enable_sleep_mode",
        "mm_processor_cache_gb",
        "disable_log_stats",
        "disable_log_requests",
    }
)

# Fingerprint keys added after 0.x: run.yaml files written before lack them, and the version
# that wrote them did not compare them, so a missing one is not compared.
NOT_COMPARED_WHEN_MISSING = frozenset({"model.seed", "model.engine_kwargs"})

# Config keys whose value names a file whose contents change outputs (frozen into DIR/files/).
FILE_KEYS = ("prompt.template_file", "sampling.structured_outputs.json")


def json_schema_path(value: Any) -> Optional[str]:
    """The file a sampling.structured_outputs.json value names; None when inline JSON or unset."""
    if isinstance(value, str) and not value.lstrip().startswith("{"):
        return value
    return None


def config_files(cfg: dict[str, Any]) -> dict[str, str]:
    """Config key -> path (as written in the config) of each file whose contents change outputs."""
    paths = {
        "prompt.template_file": cfg["prompt"].get("template_file"),
        "sampling.structured_outputs.json": json_schema_path(
            (cfg["sampling"].get("structured_outputs") or {}).get("json")
        ),
    }
    return {k: v for k, v in paths.items() if v}


def read_config_files(cfg: dict[str, Any]) -> dict[str, bytes]:
    """The bytes of every file the config names (read once: hashed and frozen from the same bytes)."""
    out = {}
    for key, path in config_files(cfg).items():
        p = Path(path).expanduser()
        try:
            out[key] = p.read_bytes()
        except OSError as e:
            raise ConfigError(f"{key} {path}: cannot read it ({e.strerror or e}; resolved to {p.absolute()})") from None
        if key == "sampling.structured_outputs.json":
            try:
                json.loads(out[key])
            except ValueError as e:
                raise ConfigError(f"{key} {path}: not a JSON schema ({e})") from None
    return out


def _file_record(path: str, data: bytes) -> dict[str, str]:
    return {"file": path, "sha256": hashlib.sha256(data).hexdigest()}


def _is_file_record(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {"file", "sha256"}


def fingerprint_keys(
    cfg: dict[str, Any], input_fingerprint: str, contents: Optional[dict[str, bytes]] = None
) -> dict[str, Any]:
    """The flat key -> value map of everything that changes outputs; a file the config names
    enters as {file, sha256} of its contents (`contents`, else read now)."""
    m, q, i = cfg["model"], cfg["quantization"], cfg["input"]
    keys: dict[str, Any] = {
        "input.fingerprint": input_fingerprint,
        "input.id_column": i["id_column"],
        "input.columns": i["columns"],
        "input.format": i["format"],
        "input.sampling_column": i["sampling_column"],
        "input.split": i["split"],
        "model.path": m["path"],
        "model.revision": m["revision"],
        "model.dtype": m["dtype"],
        "model.max_model_len": m["max_model_len"],
        "model.reasoning_parser": m["reasoning_parser"],
        "model.compact_json": m["compact_json"],
        "model.seed": m["seed"],
        "model.engine_kwargs": {
            k: v for k, v in sorted((m.get("engine_kwargs") or {}).items()) if k not in THROUGHPUT_ENGINE_KWARGS
        },
        "quantization.method": q["method"],
        "quantization.kv_cache_dtype": q["kv_cache_dtype"],
        "output.format": cfg["output"]["format"],
    }
    for group in ("prompt", "sampling", "sharding"):
        for k, v in cfg[group].items():
            keys[f"{group}.{k}"] = v
    paths = config_files(cfg)
    data = contents if contents is not None else read_config_files(cfg)
    records = {key: _file_record(path, data[key]) for key, path in paths.items()}
    if "prompt.template_file" in records:
        keys["prompt.template_file"] = records["prompt.template_file"]
    if "sampling.structured_outputs.json" in records:
        keys["sampling.structured_outputs"] = dict(
            keys["sampling.structured_outputs"], json=records["sampling.structured_outputs.json"]
        )
    return keys


def fingerprint(keys: dict[str, Any]) -> str:
    """Stable hash of the fingerprint keys."""
    blob = json.dumps(keys, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def legacy_fingerprint(keys: dict[str, Any]) -> str:
    """The hash the version before content fingerprints gave these keys: its default
    output.dir (runs/<stem>-<hash[:8]>) is still found and reopened."""
    old = {k: v for k, v in keys.items() if k not in NOT_COMPARED_WHEN_MISSING}

    def paths(value: Any) -> Any:
        if _is_file_record(value):
            return value["file"]
        return {k: paths(v) for k, v in value.items()} if isinstance(value, dict) else value

    return fingerprint({k: paths(v) for k, v in old.items()})


def key_changes(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, old value, new value) for every difference, dicts compared key by key (the name says
    which: model.engine_kwargs.quantization_param_path); files by their contents."""
    out: list[tuple[str, Any, Any]] = []
    for key in sorted(set(old) | set(new)):
        if key not in old and key in NOT_COMPARED_WHEN_MISSING:
            continue
        _diff(key, old.get(key), new.get(key), out)
    return out


def _diff(name: str, a: Any, b: Any, out: list[tuple[str, Any, Any]]) -> None:
    if _is_file_record(a) or _is_file_record(b):
        if _is_file_record(a) and _is_file_record(b):
            same = a["sha256"] == b["sha256"]
        else:  # an older run.yaml holds the path as written: that version compared the path only
            same = (a["file"] if _is_file_record(a) else a) == (b["file"] if _is_file_record(b) else b)
        if not same:
            out.append((name, a, b))
    elif isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            _diff(f"{name}.{k}", a.get(k), b.get(k), out)
    elif a != b:
        out.append((name, a, b))


def changed_keys(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Keys whose values differ between two fingerprint maps (see key_changes)."""
    return [name for name, _, _ in key_changes(old, new)]


def describe_change(name: str, old: Any, new: Any) -> str:
    """One changed key for people: `key (old -> new)`, a file as `key contents (sha256 a -> b)`."""
    if _is_file_record(old) and _is_file_record(new):
        return f"{name} contents (sha256 {old['sha256'][:12]} -> {new['sha256'][:12]}, file {new['file']})"

    def shown(v: Any) -> str:
        return f"file {v['file']} (sha256 {v['sha256'][:12]})" if _is_file_record(v) else repr(v)

    return f"{name} ({shown(old)} -> {shown(new)})"
