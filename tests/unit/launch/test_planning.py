"""Slurm planning without a cluster: arrays split at MaxArraySize, GPUs checked, env lines quoted."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.corpus import write_corpus
from support.fake_engine import fake_overrides, prepared

from batchinfer.config.compose import compose
from batchinfer.config.schema import ClusterConfig, Config, ModelConfig
from batchinfer.errors import ConfigError


def test_arrays_split_at_max_array_size_and_gpus_checked(tmp_path: Path, monkeypatch, capsys) -> None:
    from batchinfer.launch import slurm
    from batchinfer.launch.submit import submit_shards

    assert slurm.split_tasks([[0], [1], [2], [3], [4]], 2) == [[[0], [1]], [[2], [3]], [[4]]]
    run = prepared(tmp_path, 10, "cluster=slurm", "sharding.num_shards=5", "cluster.shards_per_task=1")
    monkeypatch.setattr(slurm, "max_array_size", lambda: 2)
    record = submit_shards(run, [0, 1, 2, 3, 4], dry_run=True)
    assert [a["tasks"] for a in record["arrays"]] == [{0: [0], 1: [1]}, {0: [2], 1: [3]}, {0: [4]}]
    out = capsys.readouterr().out
    assert "array 2: 1 tasks" in out and "'signal_delay_s': 120" in out and "'requeue': True" in out
    with pytest.raises(ConfigError, match=r"cluster.gpus_per_task=1 is less than .* = 2"):
        slurm.check_gpus(Config(model=ModelConfig(tensor_parallel_size=2), cluster=ClusterConfig(gpus_per_task=1)))


def test_env_lines_quote_values() -> None:
    from batchinfer.launch.slurm import env_lines

    assert env_lines({"A": "x y $(rm -rf /)", "B": None}) == ["export A='x y $(rm -rf /)'", "unset B"]
    with pytest.raises(ConfigError, match="not a valid environment variable name"):
        env_lines({"A;B": "1"})


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("partition", "gpu\n#SBATCH --time=1"),
        ("account", "a\rb"),
        ("qos", "x\nrm -rf ~"),
        ("mem", "4G\n"),
        ("constraint", "a100\x00"),
        ("sbatch_extra", {"comment": "ok\necho injected"}),
    ],
)
def test_a_line_break_in_an_sbatch_value_is_refused_before_dir_is_made(tmp_path: Path, key: str, value: object) -> None:
    """As a YAML config file can set them (a shell's $'...' too): sbatch would end its #SBATCH
    block at the line break and run the rest as a shell line, ignoring --requeue and --signal."""
    from batchinfer.launch.submit import submit

    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 4)
    cfg = compose(fake_overrides(tmp_path, corpus, "cluster=slurm"))
    cfg.cluster[key] = value
    with pytest.raises(
        ConfigError, match=rf"cluster\.{key}\S*=.* contains a (newline|carriage return|NUL).*#SBATCH lines"
    ):
        submit(cfg, dry_run=True)
    assert not (tmp_path / "run").exists()


def test_a_newline_in_output_dir_is_refused_before_it_is_made(tmp_path: Path) -> None:
    from batchinfer.launch.submit import submit

    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 4)
    cfg = compose(fake_overrides(tmp_path, corpus, "cluster=slurm"))
    cfg.output.dir = f"{tmp_path}/a\nb"
    with pytest.raises(ConfigError, match="contains a newline"):
        submit(cfg, dry_run=True)
    assert not (tmp_path / "a\nb").exists()
