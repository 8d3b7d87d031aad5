"""What `model.dtype: auto` becomes where the engine runs, and where the engine's console noise goes."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from support.corpus import write_corpus
from support.fake_engine import FakeEngine, keyed
from support.runs import fake_model_dir

from batchinfer.config.compose import compose
from batchinfer.engine import dtype
from batchinfer.errors import RunDirError
from batchinfer.launch.local import run_shards
from batchinfer.rundir.prepare import prepare
from batchinfer.rundir.store import RunDir

EPYC = "processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse2 avx avx2 fma\n"
SAPPHIRE = "model name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
GRAVITON = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


def test_auto_is_bf16_only_on_cpus_with_bf16_instructions() -> None:
    assert dtype.cpu_info(EPYC) == ("AMD EPYC 7B13", {"fpu", "sse2", "avx", "avx2", "fma"})
    assert not dtype.cpu_has_bf16(dtype.cpu_info(EPYC)[1], "x86_64")
    assert dtype.cpu_has_bf16(dtype.cpu_info(SAPPHIRE)[1], "x86_64")
    assert dtype.cpu_has_bf16({"avx512f", "amx_bf16"}, "x86_64")
    assert dtype.cpu_has_bf16(dtype.cpu_info(GRAVITON)[1], "aarch64")
    assert not dtype.cpu_has_bf16({"fp", "asimd"}, "aarch64")
    epyc = dtype.own_choice(gpu=False, cpuinfo=EPYC)
    assert epyc["dtype"] == "float32" and "AMD EPYC 7B13" in epyc["why"]
    if dtype.cpu_has_bf16(dtype.cpu_info(SAPPHIRE)[1]):  # x86 rules on an x86 host
        assert dtype.own_choice(gpu=False, cpuinfo=SAPPHIRE)["dtype"] == "bfloat16"
    assert dtype.own_choice(gpu=True, cpuinfo=EPYC)["dtype"] == "auto"  # the model's own dtype, by vLLM


def _run(tmp_path: Path, *extra: str) -> RunDir:
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 6)
    return prepare(
        compose(
            [f"input.path={corpus}", f"model.path={fake_model_dir(tmp_path)}", f"output.dir={tmp_path}/run", *extra]
        )
    )


def _chooses(monkeypatch: pytest.MonkeyPatch, choice: str) -> None:
    monkeypatch.setattr(dtype, "own_choice", lambda *a, **k: {"dtype": choice, "why": f"test node says {choice}"})


def test_first_task_records_auto_and_later_ones_adopt_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    run = _run(tmp_path)
    _chooses(monkeypatch, "float32")
    assert dtype.settle(run.path, "auto") == "float32"
    record = json.loads((run.path / "dtype.json").read_text())
    assert record["dtype"] == "float32" and record["configured"] == "auto" and "test node" in record["why"]
    _chooses(monkeypatch, "bfloat16")  # a resume on a node with bf16 instructions
    with caplog.at_level(logging.WARNING, logger="batchinfer"):
        assert dtype.settle(run.path, "auto") == "float32"
    assert "this node would have chosen bfloat16" in caplog.text
    assert json.loads((run.path / "dtype.json").read_text()) == record  # never rewritten
    assert run.run["config"]["model"]["dtype"] == "auto"  # the fingerprint keeps the configured value


def test_a_set_dtype_wins_and_is_not_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = _run(tmp_path, "model.dtype=bfloat16")
    _chooses(monkeypatch, "float32")
    assert dtype.settle(run.path, "bfloat16") == "bfloat16"
    assert not (run.path / "dtype.json").exists()


def test_a_run_directory_from_before_keeps_vllms_auto(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Parts committed by a version that passed `auto` to vLLM: the rest of the run does too."""
    run = _run(tmp_path)
    _chooses(monkeypatch, "float32")
    run_shards(run, [0], engine=keyed(FakeEngine(), run))
    (run.path / "dtype.json").unlink()  # as an older version left it
    assert run.shard_folder(0).committed_files()
    assert dtype.settle(run.path, "auto") == "auto"
    assert "before batchinfer resolved auto" in json.loads((run.path / "dtype.json").read_text())["why"]


def test_two_first_tasks_agree_on_one_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = _run(tmp_path)
    real = dtype.create_once

    def other_node_wins(path: Path, data: bytes) -> bool:
        real(path, json.dumps({"dtype": "bfloat16", "host": "other", "why": "it has amx_bf16"}).encode())
        return real(path, data)

    monkeypatch.setattr(dtype, "create_once", other_node_wins)
    _chooses(monkeypatch, "float32")
    assert dtype.settle(run.path, "auto") == "bfloat16"
    assert json.loads((run.path / "dtype.json").read_text())["host"] == "other"


def test_an_engine_in_another_dtype_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = _run(tmp_path)
    _chooses(monkeypatch, "float32")
    eng: Any = keyed(FakeEngine(), run)
    eng.dtype = "bfloat16"
    with pytest.raises(RunDirError, match="runs bfloat16; this run's shards use float32"):
        run_shards(run, [0], engine=eng)
    eng.dtype = "float32"
    run_shards(run, [0], engine=eng)
    done = json.loads(run.shard_folder(0).done_path.read_text())
    assert done["model"]["dtype"] == "float32"  # what the engine ran, not `auto`


NOISY = textwrap.dedent(
    """
    import logging, os, subprocess, sys
    from pathlib import Path
    from batchinfer.logs import setup_logging
    from batchinfer.engine.output import EngineOutput
    from batchinfer.errors import EngineFailure

    setup_logging()
    log = logging.getLogger("batchinfer")
    print("before on stdout", flush=True)
    try:
        with EngineOutput(Path(sys.argv[1])) as out:
            os.write(2, b"oneDNN noise from native code\\n")
            os.write(1, b"Triton noise on fd 1\\n")
            print("FutureWarning from python", file=sys.stderr, flush=True)
            subprocess.run([sys.executable, "-c", "import sys; sys.stderr.write('engine core says hi\\\\n')"])
            log.info("batchinfer line while the engine runs")
            out.bar_file().write("progress 3/6\\n")
            if sys.argv[2] == "fail":
                os.write(2, b"CUDA out of memory, the cause\\n")
                raise EngineFailure("shard 0 failed")
    except EngineFailure:
        pass
    print("after on stdout", flush=True)
    log.info("after on stderr")
    """
)


@pytest.mark.parametrize("how", ["ok", "fail"])
def test_engine_noise_goes_to_its_log_and_errors_show_its_tail(tmp_path: Path, how: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}
    res = subprocess.run(
        [sys.executable, "-c", NOISY, str(tmp_path / "logs"), how], capture_output=True, text=True, env=env
    )
    assert res.returncode == 0, res.stderr
    (log_file,) = (tmp_path / "logs").glob("engine-*.log")
    noise = log_file.read_text()
    for line in ("oneDNN noise", "Triton noise", "FutureWarning from python", "engine core says hi"):
        assert line in noise
        assert line not in res.stdout
    assert "batchinfer line while the engine runs" in res.stderr and "progress 3/6" in res.stderr
    assert res.stdout.splitlines() == ["before on stdout", "after on stdout"]
    assert "after on stderr" in res.stderr and f"engine output goes to {log_file}" in res.stderr
    if how == "fail":
        tail = res.stderr.split(f"last lines of the engine log {log_file}:")[1]
        assert "CUDA out of memory, the cause" in tail and "oneDNN noise" in tail
    else:
        assert "oneDNN noise" not in res.stderr and "last lines" not in res.stderr
    asked = subprocess.run(
        [sys.executable, "-c", NOISY, str(tmp_path / "asked"), how],
        capture_output=True,
        text=True,
        env=dict(env, VLLM_LOGGING_LEVEL="INFO"),
    )
    assert "oneDNN noise" in asked.stderr and not (tmp_path / "asked").exists()  # asked for on the console


def test_a_vllm_without_the_watchdogs_internals_is_refused_loudly() -> None:
    """The dead-engine watchdog reads SyncMPClient internals; where they are gone, say so at start."""
    from types import SimpleNamespace

    from batchinfer.engine.watchdog import Watchdog

    with pytest.raises(RuntimeError, match=r"SimpleNamespace has no resources, outputs_queue, which batchinfer"):
        Watchdog(SimpleNamespace())
    with pytest.raises(RuntimeError, match=r"has no resources.engine_dead"):
        Watchdog(SimpleNamespace(resources=object(), outputs_queue=object()))
