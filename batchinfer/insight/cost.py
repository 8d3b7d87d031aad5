"""GPU-hours, dollars and energy of a run's tokens."""

from __future__ import annotations

from typing import Optional, TypedDict

from batchinfer.config.schema import Config
from batchinfer.errors import ConfigError
from batchinfer.models.sizing import gpu_names
from batchinfer.rundir.progress import engine_record
from batchinfer.rundir.stats import ShardStats, Totals

# Assumed on-demand list prices, USD per GPU-hour, of specialized GPU clouds (Lambda-style price
# pages, 2025; hyperscalers list 2-4x more). Not fetched: pass --gpu-hour-price for your own rate.
GPU_HOUR_PRICES = {
    "H100-80GB": 2.99,
    "H200-141GB": 3.79,
    "A100-40GB": 1.29,
    "A100-80GB": 1.79,
    "L40S-48GB": 1.00,
    "B200-180GB": 4.99,
}
PRICES_NOTE = "assumed 2025 on-demand list price of specialized GPU clouds; pass --gpu-hour-price for yours"


class EngineLayout(TypedDict):
    """Engines per task, and the GPUs each engine's shard seconds counted (per task when 1)."""

    engines_per_task: int
    gpus_per_engine: int


class CostRecord(TypedDict, total=False):
    """The report's `cost` (cost): GPU-hours always; USD with a price; energy with watts."""

    gpus_per_task: int
    cpu: bool  # cluster.gpus_per_task=0: CPU tasks, counted as 1 "GPU" each
    nodes_per_task: int
    gpu_hours: float
    engine_layouts: list[EngineLayout]
    usd_per_gpu_hour: float
    price_source: Optional[str]
    usd: float
    usd_per_1k_output_tokens: Optional[float]
    usd_per_1k_total_tokens: Optional[float]
    usd_per_1m_rows: Optional[float]  # what embedding and classification runs compare
    watts_per_gpu: float
    kwh: float
    joules_per_output_token: Optional[float]
    joules_per_total_token: Optional[float]


def hourly_price(price: Optional[float], gpu: Optional[str]) -> tuple[Optional[float], Optional[str]]:
    """(USD per GPU-hour, where it comes from): --gpu-hour-price wins over a --gpu preset's price."""
    if price is not None:
        if price < 0:
            raise ConfigError(f"--gpu-hour-price {price}: must not be negative")
        return price, "--gpu-hour-price"
    if gpu is None:
        return None, None
    names = gpu_names(gpu)
    if len(names) != 1:
        raise ConfigError(f"--gpu {gpu}: name one GPU preset for a price ({', '.join(GPU_HOUR_PRICES)})")
    return GPU_HOUR_PRICES[names[0]], f"{names[0]} preset ({PRICES_NOTE})"


def task_nodes(cfg: Config) -> int:
    """Nodes each task held: cluster.nodes_per_task (1 in a run.yaml from before the key)."""
    return int(getattr(cfg.cluster, "nodes_per_task", 1) or 1)


def gpus_per_task(cfg: Config, devices: list[Optional[str]]) -> int:
    """GPUs a task holds (0: CPU): cluster.gpus_per_task on each of its cluster.nodes_per_task nodes
    under Slurm; in a local run the engine's tensor x pipeline parallel GPUs, or 0 when the recorded
    device is a CPU."""
    if cfg.cluster.name != "local":
        return int(cfg.cluster.gpus_per_task) * task_nodes(cfg)
    if any(d and not d.startswith("CPU") for d in devices):
        return cfg.model.tensor_parallel_size * cfg.model.pipeline_parallel_size
    return 0


def configured_engines(cfg: Config, task_gpus: int) -> int:
    """cluster.engines_per_task of the run's config for a task of task_gpus GPUs; 1 if it cannot run."""
    from batchinfer.config.engines import engines_per_task

    try:
        return engines_per_task(cfg, task_gpus)
    except (ConfigError, AttributeError, TypeError, ValueError):  # a run.yaml from before the key: 1
        return 1


def engine_gpu_seconds(cfg: Config, task_gpus: int, shards: list[ShardStats]) -> tuple[float, dict[int, int]]:
    """(GPU-seconds of the shards, {engines per task: GPUs counted per engine} of the layouts seen).

    A task of N engines runs N shards at once, each on one engine: a shard's seconds count
    max(task GPUs // N, tensor x pipeline parallel size) GPUs (the task's GPUs shared by its engines),
    N from the shard's engine record, else the config. A CPU task's engine counts as 1 GPU, an
    engine over several nodes (cluster.nodes_per_task) as 1 a node."""
    each = cfg.model.tensor_parallel_size * cfg.model.pipeline_parallel_size
    default = configured_engines(cfg, task_gpus)
    nodes = task_nodes(cfg)
    total, layouts = 0.0, {}
    for s in shards:
        seconds = sum(s["seconds"].values())
        eng = engine_record(s.get("engine"))
        n = eng["of"] if eng else default
        gpus = max(task_gpus // n, each) if task_gpus else nodes
        total += seconds * gpus
        if seconds:
            layouts[n] = gpus
    return total, dict(sorted(layouts.items()))


def cost(
    tot: Totals,
    gpus_per_task: int,
    price: Optional[float] = None,
    gpu: Optional[str] = None,
    watts: Optional[float] = None,
    gpu_seconds: Optional[float] = None,
    layouts: Optional[dict[int, int]] = None,
    nodes: int = 1,
) -> CostRecord:
    """GPU-hours = (start-up + prepare + generate + commit seconds of all shards) x GPUs per task / 3600,
    or the given gpu_seconds / 3600 (engine_gpu_seconds: tasks of several engines, whose layouts say
    how many GPUs each engine counted); with a price, USD and USD per 1K output / total tokens; with
    watts per GPU, kWh and J per token. nodes: cluster.nodes_per_task, whose GPUs gpus_per_task
    counts already (a CPU task: 1 "GPU" a node)."""
    gpus = gpus_per_task or nodes
    if gpu_seconds is None:
        gpu_seconds = sum(tot["seconds"].values()) * gpus
    out_tok, all_tok = tot["output_tokens"], tot["prompt_tokens"] + tot["output_tokens"]
    rec: CostRecord = {
        "gpus_per_task": gpus,
        "cpu": not gpus_per_task,  # cluster.gpus_per_task=0: CPU tasks, counted as 1 "GPU" each
        "nodes_per_task": nodes,
        "gpu_hours": gpu_seconds / 3600,
        # engines per task -> GPUs counted per engine (per task when 1), for the layouts the shards ran in
        "engine_layouts": [EngineLayout(engines_per_task=n, gpus_per_engine=g) for n, g in (layouts or {}).items()],
    }
    usd_per_hour, source = hourly_price(price, gpu)
    if usd_per_hour is not None:
        usd = rec["gpu_hours"] * usd_per_hour
        rec.update(
            usd_per_gpu_hour=usd_per_hour,
            price_source=source,
            usd=usd,
            usd_per_1k_output_tokens=1000 * usd / out_tok if out_tok else None,
            usd_per_1k_total_tokens=1000 * usd / all_tok if all_tok else None,
            # what embedding and classification runs compare: they generate no tokens
            usd_per_1m_rows=1e6 * usd / tot["rows_done"] if tot.get("rows_done") else None,
        )
    if watts is not None:
        if watts <= 0:
            raise ConfigError(f"--gpu-watts {watts}: must be positive")
        joules = watts * gpu_seconds
        rec.update(
            watts_per_gpu=watts,
            kwh=joules / 3.6e6,
            joules_per_output_token=joules / out_tok if out_tok else None,
            joules_per_total_token=joules / all_tok if all_tok else None,
        )
    return rec


def cost_lines(c: CostRecord) -> list[str]:
    """The cost section of the report, as markdown lines."""
    lines = [
        f"- GPU-hours: {c['gpu_hours']:,.4f} (start-up + prepare + generate + commit seconds x GPUs: {_gpus_what(c)})"
    ]
    if "usd" in c:
        lines.append(
            f"- price: ${c['usd_per_gpu_hour']:,.2f} per GPU-hour ({c['price_source']}); cost ${c['usd']:,.4f}"
        )
        lines.append(
            f"- ${_money(c['usd_per_1k_output_tokens'])} per 1K output tokens, "
            f"${_money(c['usd_per_1k_total_tokens'])} per 1K total (prompt + output) tokens, "
            f"${_money(c.get('usd_per_1m_rows'))} per 1M rows"
        )
    else:
        lines.append("- cost: pass --gpu-hour-price USD or --gpu PRESET")
    if "kwh" in c:
        lines.append(
            f"- energy at {c['watts_per_gpu']:g} W per GPU: {c['kwh']:,.4f} kWh; "
            f"{_money(c['joules_per_output_token'])} J per output token, "
            f"{_money(c['joules_per_total_token'])} J per total token"
        )
    return lines


def _gpus_what(c: CostRecord) -> str:
    """The GPUs each shard's seconds count: per task, or per engine when tasks ran several."""
    multi = [lay for lay in c.get("engine_layouts", []) if lay["engines_per_task"] > 1]
    nodes = c.get("nodes_per_task", 1)
    if nodes > 1:  # one engine over the nodes (cluster.engines_per_task=1 is required with it)
        if c["cpu"]:
            return f"CPU tasks, no GPU: each of a task's {nodes} nodes (cluster.nodes_per_task) counted as 1 GPU"
        return (
            f"{c['gpus_per_task']} per task: cluster.nodes_per_task={nodes} nodes x "
            f"{c['gpus_per_task'] // nodes} GPUs on each"
        )
    if not multi:
        return "CPU tasks, no GPU: each counted as 1 GPU" if c["cpu"] else f"{c['gpus_per_task']} per task"
    if c["cpu"]:
        ns = " or ".join(str(lay["engines_per_task"]) for lay in multi)
        return f"CPU tasks, no GPU: each of {ns} engines per task counted as 1 GPU, its shards' seconds its own"
    parts = [
        f"{lay['gpus_per_engine']} per engine for shards of tasks running {lay['engines_per_task']} engines"
        if lay["engines_per_task"] > 1
        else f"{lay['gpus_per_engine']} per task for shards of single-engine tasks"
        for lay in c["engine_layouts"]
    ]
    return f"{'; '.join(parts)}; a task's cluster.gpus_per_task={c['gpus_per_task']} shared by its engines"


def _money(x: Optional[float]) -> str:
    """Small amounts with 4 significant digits (0.0001234), large ones with 2 decimals."""
    if x is None:
        return "-"
    return f"{x:,.2f}" if x >= 100 else f"{x:.4g}"
