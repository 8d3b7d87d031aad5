"""The fingerprint: which config keys change outputs, their digest, and how two runs differ."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Optional

from batchinfer.config.json_schema import KEY as JSON_KEY
from batchinfer.config.json_schema import json_schema_path, parse_json_schema, read_json_schema
from batchinfer.errors import ConfigError
from batchinfer.redaction import shown_change
from batchinfer.security import check_file_secrets

# engine_kwargs that change speed or memory, not what greedy decoding generates: a run may be
# reopened or resumed with other values. speculative_config is one (the speculative=ngram preset
# keeps greedy outputs; with temperature > 0 the samples differ, as a changed batch can make
# them). Every other engine_kwargs key is part of the fingerprint. Listed in docs/inputs-outputs.md ("The run directory").
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

IMAGE_KEYS = "image_"  # prompt.image_column and its limits: fingerprinted only when it is set

# Config keys whose value names a file whose contents change outputs (frozen into DIR/files/).
FILE_KEYS = ("prompt.template_file", "sampling.structured_outputs.json")


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
    """The bytes of every file the config names (read once: hashed and frozen from the same bytes),
    refused when one holds a secret (security.check_file_secrets): prepare copies them into DIR/files."""
    out = {}
    for key, path in config_files(cfg).items():
        if key == JSON_KEY:
            out[key] = read_json_schema(path)
            parse_json_schema(out[key], f"{key} {path}")
            continue
        p = Path(path).expanduser()
        try:
            out[key] = p.read_bytes()
        except OSError as e:
            raise ConfigError(f"{key} {path}: cannot read it ({e.strerror or e}; resolved to {p.absolute()})") from None
    check_file_secrets(config_files(cfg), out)
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
    lora = m.get("lora") or {}
    if lora.get("adapters"):  # only with adapters: runs without keep their fingerprint
        # the folders' contents enter through the model identity (rundir/model_record.py)
        keys["model.lora.adapters"] = dict(sorted(lora["adapters"].items()))
        keys["model.lora.default"] = lora.get("default")
        keys["input.adapter_column"] = i.get("adapter_column")
    if i.get("sampling_overridden"):  # only when set: runs made before the key keep their fingerprint
        keys["input.sampling_overridden"] = sorted(i["sampling_overridden"])
    for group in ("prompt", "sampling", "sharding"):
        for k, v in cfg[group].items():
            if group == "prompt" and k.startswith(IMAGE_KEYS) and not cfg["prompt"].get("image_column"):
                continue  # runs without images keep the fingerprint (and output.dir) they had
            keys[f"{group}.{k}"] = v
    task = cfg.get("task") or {"name": "generate"}
    if task["name"] != "generate":  # generation runs keep the fingerprint (and output.dir) they had
        keys.update({f"task.{k}": v for k, v in task.items()})
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


# Fingerprint keys that reach an answer only through its request's prompt token ids and the row's
# own sampling (the corpus, template, system prompt, overlong policy, chat template kwargs), or that
# say only where rows go (ids, carried columns, sharding, output format). A request digest
# (requests/digest.py) holds those ids and that sampling instead; every other fingerprint key enters
# it. prompt.labels stays: it decides the `label` and `label_confidence` columns of an answer.
STOOD_FOR_BY_REQUEST = ("input.", "prompt.", "sharding.", "output.")
ANSWER_PROMPT_KEYS = frozenset({"prompt.labels"})


def answer_keys(keys: dict[str, Any]) -> dict[str, Any]:
    """The fingerprint keys that change an answer beyond its request's token ids and own sampling;
    a file enters by its contents alone (two runs may name one schema by different paths)."""

    def contents(value: Any) -> Any:
        if _is_file_record(value):
            return {"sha256": value["sha256"]}
        return {k: contents(v) for k, v in value.items()} if isinstance(value, dict) else value

    return {
        k: contents(v) for k, v in keys.items() if k in ANSWER_PROMPT_KEYS or not k.startswith(STOOD_FOR_BY_REQUEST)
    }


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

    return f"{name} ({shown_change(shown(old), shown(new))})"
