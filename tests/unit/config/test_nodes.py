"""cluster.nodes_per_task: the layouts accepted and refused (config/nodes.py), and what submit's dry
run and plan say about them, without a cluster or an engine."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.fake_engine import prepared

from batchinfer.config.compose import compose
from batchinfer.config.nodes import check_nodes
from batchinfer.config.schema import ClusterConfig, Config, ModelConfig
from batchinfer.errors import ConfigError


def layout(nodes: int, tp: int, pp: int = 1, gpus: int = 0, engines: object = 1) -> Config:
    return Config(
        model=ModelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp),
        cluster=ClusterConfig(name="slurm", nodes_per_task=nodes, gpus_per_task=gpus, engines_per_task=engines),
    )


def test_tp_x_pp_must_be_nodes_x_gpus_per_node() -> None:
    assert check_nodes(layout(1, 1)) == 1
    assert check_nodes(layout(2, 8, 2, gpus=8)) == 2  # TP = GPUs per node, PP = nodes
    assert check_nodes(layout(2, 16, 1, gpus=8)) == 2  # TP over both nodes is accepted too
    assert check_nodes(layout(2, 2)) == 2  # CPU: one rank per node
    with pytest.raises(ConfigError) as e:
        check_nodes(layout(2, 8, 1, gpus=8))
    assert str(e.value).startswith(
        "model.tensor_parallel_size=8 x model.pipeline_parallel_size=1 = 8 ranks, but cluster.nodes_per_task=2 "
        "nodes x cluster.gpus_per_task=8 GPUs per node = 16; they must be equal"
    )
    with pytest.raises(ConfigError, match=r"cluster.nodes_per_task=3 nodes x 1 rank \(CPU: cluster.gpus_per_task=0\)"):
        check_nodes(layout(3, 2))


def test_several_engines_per_task_and_bad_values_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"cluster.engines_per_task=2 .* cannot be combined with it"):
        check_nodes(layout(2, 2, engines=2))
    with pytest.raises(ConfigError, match=r"cluster.engines_per_task=auto .* cannot be combined"):
        check_nodes(layout(2, 2, engines="auto"))
    with pytest.raises(ConfigError, match=r"cluster.nodes_per_task=0 is out of range"):
        check_nodes(layout(0, 1))


def test_validate_refuses_a_layout_before_anything_is_made(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"= 4 ranks, but cluster.nodes_per_task=2 nodes x cluster.gpus_per_task=1"):
        compose(["cluster=slurm", "cluster.nodes_per_task=2", "model.tensor_parallel_size=4", "input.path=x"])


def test_dry_run_asks_for_the_nodes_and_says_who_runs_what(tmp_path: Path, capsys) -> None:
    from batchinfer.launch import slurm
    from batchinfer.launch.submit import submit_shards

    run = prepared(
        tmp_path,
        8,
        "cluster=slurm",
        "sharding.num_shards=2",
        "cluster.nodes_per_task=2",
        "model.tensor_parallel_size=2",
        "cluster.gpus_per_task=0",
    )
    slurm_max = slurm.max_array_size
    try:
        slurm.max_array_size = lambda: 1001
        submit_shards(run, [0, 1], dry_run=True)
    finally:
        slurm.max_array_size = slurm_max
    out = capsys.readouterr().out
    assert "engines per task" not in out
    assert (
        "nodes per task: 2 (cluster.nodes_per_task=2), 1 CPU rank on each: one engine of TP 2 x PP 1 = 2 ranks" in out
    )
    assert "'nodes': 2, 'ntasks_per_node': 1, 'srun_args': ['--nodes=1', '--ntasks=1']" in out
    params = slurm.array_parameters(run.config.cluster, 2)
    assert (params["nodes"], params["ntasks_per_node"]) == (2, 1)
    # one node: the parameters are as before, no node keys
    assert not {"nodes", "ntasks_per_node", "srun_args"} & set(slurm.array_parameters(ClusterConfig(), 2))


def test_plan_says_the_nodes_or_what_submit_would_refuse() -> None:
    from batchinfer.insight.plan import engines_section
    from batchinfer.insight.plan_text import _engines_lines

    ok = engines_section(layout(2, 8, 2, gpus=8), None)
    assert _engines_lines(ok) == [
        "nodes    2 (cluster.nodes_per_task=2), 8 GPUs on each: one engine of TP 8 x PP 2 = 16 ranks; the first "
        "node runs the worker (the only writer of the run directory), the other 1 run engine ranks only"
    ]
    bad = engines_section(layout(2, 8, 1, gpus=8), None)
    assert _engines_lines(bad)[0].startswith("warning  model.tensor_parallel_size=8 x model.pipeline_parallel_size=1")


def test_one_host_address_for_every_node_is_refused() -> None:
    cfg = layout(2, 2)
    cfg.cluster.env = {"GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "ib0"}
    assert check_nodes(cfg) == 2  # interface names are the same on every node: passed through
    cfg.cluster.env["VLLM_HOST_IP"] = "10.0.0.1"
    with pytest.raises(ConfigError, match=r"cluster.env.VLLM_HOST_IP with cluster.nodes_per_task=2 would give"):
        check_nodes(cfg)
    one = layout(1, 1)
    one.cluster.env = {"VLLM_HOST_IP": "10.0.0.1"}
    assert check_nodes(one) == 1  # one node: VLLM_HOST_IP is the user's to set
