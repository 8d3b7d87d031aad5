"""One engine over several nodes (cluster.nodes_per_task): which layouts are accepted, and the
record an engine spanning nodes is built from.

Rank 0 (the task's first node) runs the worker, the only writer of the run directory; every other
node runs vLLM's headless executor only. vLLM places tensor x pipeline parallel ranks over the
nodes, so TP x PP must be exactly the ranks the nodes hold: cluster.gpus_per_task GPUs on each
node, or on a CPU partition (cluster.gpus_per_task=0) one rank per node (vLLM's CPU backend runs
one rank per process, and a rank's OpenMP threads take the node's cores)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from batchinfer.errors import ConfigError

# vLLM's worker whose failed step ends its process (engine/vllm_engine.py): a worker that raised and
# lived on would leave the other nodes waiting on it for ever.
RANK_WORKER = "batchinfer.engine.vllm_engine.RankWorker"


@dataclass(frozen=True)
class NodeGroup:
    """Where an engine over several nodes meets: vLLM's nnodes, the head's address and port, and the
    engine arguments the head resolved (vLLM's defaults for them), given to every node alike."""

    nnodes: int
    master_addr: str
    master_port: int
    engine_args: dict[str, Any] = field(default_factory=dict, compare=False)


def ranks_per_node(cfg: Any) -> int:
    """Engine ranks on each node: cluster.gpus_per_task, or 1 on a CPU partition."""
    return int(cfg.cluster.gpus_per_task) or 1


def check_nodes(cfg: Any) -> int:
    """cluster.nodes_per_task, refused naming the settings when TP x PP is not nodes x ranks per
    node or when combined with cluster.engines_per_task != 1."""
    cl = cfg.cluster
    nodes = cl.nodes_per_task
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ConfigError(f"cluster.nodes_per_task={nodes!r} is out of range: it takes an integer >= 1")
    if nodes == 1:
        return 1
    if cl.engines_per_task != 1:
        raise ConfigError(
            f"cluster.nodes_per_task={nodes} runs one engine over {nodes} nodes; cluster.engines_per_task="
            f"{cl.engines_per_task} (several engines in a task) cannot be combined with it: set "
            "cluster.engines_per_task=1, or cluster.nodes_per_task=1"
        )
    if "VLLM_HOST_IP" in (cl.env or {}):
        # cluster.env reaches every node alike, and each node must announce its own address
        raise ConfigError(
            f"cluster.env.VLLM_HOST_IP with cluster.nodes_per_task={nodes} would give every node the same "
            "address; unset it and choose the network by interface instead, the same name on every node: "
            "cluster.env.GLOO_SOCKET_IFNAME=<ifname> (CPU, and vLLM's own messages) and "
            "cluster.env.NCCL_SOCKET_IFNAME=<ifname> (GPUs)"
        )
    tp, pp = int(cfg.model.tensor_parallel_size), int(cfg.model.pipeline_parallel_size)
    per = ranks_per_node(cfg)
    where = f"cluster.gpus_per_task={per} GPUs" if cl.gpus_per_task else "1 rank (CPU: cluster.gpus_per_task=0)"
    if tp * pp != nodes * per:
        raise ConfigError(
            f"model.tensor_parallel_size={tp} x model.pipeline_parallel_size={pp} = {tp * pp} ranks, but "
            f"cluster.nodes_per_task={nodes} nodes x {where} per node = {nodes * per}; they must be equal "
            f"(the usual layout: tensor_parallel_size = GPUs per node, pipeline_parallel_size = nodes)"
        )
    return nodes


def describe_nodes(cfg: Any) -> str:
    """One line for plan and submit --dry-run: the nodes, ranks and who runs what."""
    n = cfg.cluster.nodes_per_task
    per = ranks_per_node(cfg)
    each = f"{per} GPU{'s' * (per != 1)}" if cfg.cluster.gpus_per_task else "1 CPU rank"
    tp, pp = cfg.model.tensor_parallel_size, cfg.model.pipeline_parallel_size
    return (
        f"{n} (cluster.nodes_per_task={n}), {each} on each: one engine of TP {tp} x PP {pp} = {n * per} ranks; "
        f"the first node runs the worker (the only writer of the run directory), the other "
        f"{n - 1} run engine ranks only"
    )


def node_kwargs(nodes: Optional[NodeGroup], node_rank: int = 0) -> dict[str, Any]:
    """vLLM's arguments of one node of an engine over several nodes: its node_rank and where the
    nodes meet, with the mp backend as `vllm serve --headless` runs it (no Ray), the worker whose
    failed step ends it, and the arguments the head resolved; {} for one node."""
    if nodes is None or nodes.nnodes == 1:
        return {}
    return {
        **nodes.engine_args,
        "worker_cls": RANK_WORKER,
        "nnodes": nodes.nnodes,
        "node_rank": node_rank,
        "master_addr": nodes.master_addr,
        "master_port": nodes.master_port,
        "distributed_executor_backend": "mp",
    }
