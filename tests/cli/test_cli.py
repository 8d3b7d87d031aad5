"""The CLI as a user types it: messages, --cfg job, no vllm/torch import where none is needed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.corpus import write_corpus
from support.procs import run_cli
from support.runs import fake_model_dir, model_overrides

from batchinfer.config.compose import compose
from batchinfer.launch.local import run_local


def test_console_script_is_installed() -> None:
    exe = shutil.which("batchinfer")
    assert exe, "the batchinfer console script is not on PATH: pip install -e .[cpu,test]"
    res = subprocess.run([exe, "--help"], capture_output=True, text=True)
    assert res.returncode == 0 and "run" in res.stdout and "merge" in res.stdout


def test_cfg_job_prints_resolved_config_with_literal_template() -> None:
    res = run_cli(
        ["run", "--cfg", "job", "input.path=x.jsonl", "prompt.template=Label: {text}", "sampling.max_tokens=9"]
    )
    assert res.returncode == 0, res.stderr
    assert (
        "template: 'Label: {text}'" in res.stdout and "max_tokens: 9" in res.stdout and "temperature: 0.0" in res.stdout
    )


def test_unknown_key_missing_input_and_bad_value_messages(tmp_path: Path) -> None:
    res = run_cli(["run", "--bogus"])
    assert res.returncode == 2 and "unrecognized arguments: --bogus" in res.stderr
    # One line naming the key, its section's keys and the closest; not Hydra's advice to write +key.
    for command, key in (
        ("run", "sampling.max_tokenz=3"),
        ("validate", "+sampling.max_tokenz=3"),
        ("submit", "+input.idcolumn=x"),
    ):
        res = run_cli([command, key])
        name = key.lstrip("+").split("=")[0]
        assert res.returncode == 2 and f"batchinfer: error: {name} is not a key (did you mean " in res.stderr, (
            res.stderr
        )
        assert "Traceback" not in res.stderr and "+" + name not in res.stderr and len(res.stderr.splitlines()) == 1
    res = run_cli(["run", f"input.path={tmp_path}/missing.jsonl", f"model.path={fake_model_dir(tmp_path)}"])
    assert res.returncode == 2 and f"input.path {tmp_path}/missing.jsonl: no such file" in res.stderr
    write_corpus(tmp_path / "c.jsonl", 3)
    res = run_cli(["run", f"input.path={tmp_path}/c.jsonl", f"model.path={tmp_path}/nope"])
    assert res.returncode == 2 and f"model.path {tmp_path}/nope: no model folder with a config.json there" in res.stderr
    assert "Traceback" not in res.stderr


NO_ENGINE_IMPORTS = """
import sys
from batchinfer.cli import main
code = main(sys.argv[1:])
heavy = sorted(m for m in ("vllm", "torch", "transformers") if m in sys.modules)
print("HEAVY", heavy)
sys.exit(code)
"""


@pytest.mark.engine
def test_finished_dir_rerun_and_merge_import_no_vllm(tmp_path: Path, tiny_model_path: Path, engine: Any) -> None:
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 12)
    ov = [
        f"input.path={corpus}",
        f"output.dir={tmp_path}/run",
        "sampling.max_tokens=4",
        *model_overrides(tiny_model_path),
    ]
    run_local(compose(ov), engine=engine)
    res = subprocess.run([sys.executable, "-c", NO_ENGINE_IMPORTS, "run", *ov], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "is already complete: 12 rows" in res.stdout and "HEAVY []" in res.stdout
    res = subprocess.run(
        [sys.executable, "-c", NO_ENGINE_IMPORTS, "merge", f"{tmp_path}/run"], capture_output=True, text=True
    )
    assert res.returncode == 0 and "merged 12 rows" in res.stdout and "HEAVY []" in res.stdout


def test_merge_of_incomplete_dir_names_shards(tmp_path: Path) -> None:
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 6)
    from batchinfer.rundir.prepare import prepare

    prepare(
        compose(
            [
                f"input.path={corpus}",
                f"output.dir={tmp_path}/run",
                f"model.path={fake_model_dir(tmp_path)}",
                "sharding.num_shards=2",
            ]
        )
    )
    res = run_cli(["merge", f"{tmp_path}/run"])
    assert res.returncode == 2 and "2 of 2 shards are incomplete (shards 0, 1)" in res.stderr


def test_lock_refusal_from_a_second_process(tmp_path: Path) -> None:
    from batchinfer.locks import ShardLock
    from batchinfer.rundir.prepare import prepare

    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 4)
    run = prepare(
        compose([f"input.path={corpus}", f"output.dir={tmp_path}/run", f"model.path={fake_model_dir(tmp_path)}"])
    )
    with ShardLock(run.shard_dir(0), mode=run.config.output.lock):
        res = run_cli(["worker", str(run.path), "0"])
    assert res.returncode == 2
    assert "00000: shard is being written by host" in res.stderr and "wait for it or cancel it" in res.stderr


def test_engine_that_fails_to_start_shows_its_log_tail(tmp_path: Path) -> None:
    """Engine output goes to DIR/logs, but a failure prints that file's last lines and its path."""
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 4)
    model = tmp_path / "unknown-architecture"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["NoSuchForCausalLM"], "model_type": "llama"}))
    out = tmp_path / "run"
    res = run_cli(
        ["run", f"input.path={corpus}", f"model.path={model}", f"output.dir={out}", "model.enforce_eager=true"]
    )
    assert res.returncode == 1
    (log_file,) = out.glob("logs/engine-*.log")
    tail = res.stderr.split(f"last lines of the engine log {log_file}:")[1]
    assert "non-default args" in tail and "non-default args" in log_file.read_text()  # vLLM's own INFO line
    assert "NoSuchForCausalLM" in res.stderr.split("batchinfer: error: shard 0 failed")[1]  # the cause, last
