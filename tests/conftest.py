"""Shared fixtures: the tiny model, one in-process engine, corpora and run helpers."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # else the CPU backend reserves 90% of RAM

import tiny_model  # noqa: E402

WORDS = ["dog", "fox", "hello", "world", "label", "physics", "biology", "quick", "lazy", "jumps", "abstract", "brown"]
# One engine config for every in-process test, so they can share the session engine.
ENGINE_OVERRIDES = ["model.enforce_eager=true", "model.max_model_len=128", "model.max_num_seqs=16"]
COMPARE = ["row", "id", "text", "finish_reason", "prompt_tokens", "output_tokens", "error"]


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


def model_overrides(model: Path) -> list[str]:
    """Overrides that select the tiny model with the shared engine's settings."""
    return [f"model.path={model}", *ENGINE_OVERRIDES]


def run_overrides(model: Path, corpus: Path, out: Path, *extra: str) -> list[str]:
    """A small run of corpus into out on the tiny model, with the shared engine's settings."""
    return [
        f"input.path={corpus}",
        f"output.dir={out}",
        "input.id_column=id",
        "sampling.max_tokens=6",
        *model_overrides(model),
        *extra,
    ]


def fake_model_dir(parent: Path) -> Path:
    """A folder that passes the model.path check, for tests that never start an engine."""
    d = parent / "fake-model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text("{}")
    return d


def write_corpus(
    path: Path, n: int, seed: int = 0, fmt: str = "jsonl", min_words: int = 2, max_words: int = 12
) -> list[dict]:
    """n rows {id, text} of random words; as JSONL or Parquet."""
    rng = random.Random(seed)
    rows = [
        {"id": f"doc-{i:05d}", "text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words)))}
        for i in range(n)
    ]
    if fmt == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def read_output(run_dir: Path) -> list[dict]:
    """The merged output rows of a run directory (one file, split files, or a save_to_disk folder)."""
    if (run_dir / "output" / "state.json").exists():
        import datasets

        return datasets.load_from_disk(str(run_dir / "output")).to_list()
    files = sorted((run_dir / "output").glob("output-*")) or [
        p for p in (run_dir / "output.parquet", run_dir / "output.jsonl") if p.exists()
    ]
    rows: list[dict] = []
    for f in files:
        if f.suffix == ".parquet":
            rows += pq.read_table(f).to_pylist()
        else:
            rows += [json.loads(line) for line in f.read_text().splitlines()]
    return rows


def project(rows: list[dict]) -> list[dict]:
    """The columns two runs of the same config must agree on."""
    return [{k: r.get(k) for k in COMPARE} for r in rows]


def assert_exactly_once(rows: list[dict], inputs: list[dict]) -> None:
    """Every input row once, in input order, with its id, and a text that is the row's own."""
    assert [r["row"] for r in rows] == list(range(len(inputs)))
    assert [r["id"] for r in rows] == [x["id"] for x in inputs]
    for r, x in zip(rows, inputs, strict=True):
        assert r["error"] is None, r
        assert_own_output(r, x["text"])


def assert_own_output(out: dict, prompt_text: str) -> None:
    """The tiny model repeats the prompt's last token: the output text belongs to this row."""
    n = out["output_tokens"]
    unit = out["text"][: len(out["text"]) // n]
    assert unit * n == out["text"] and unit.strip() and prompt_text.endswith(unit.strip()), (out, prompt_text)


def run_cli(
    args: list[str], env: dict | None = None, timeout: float = 600, spy: Path | None = None, **kw: Any
) -> subprocess.CompletedProcess:
    """Run the batchinfer CLI in its own process group (its id is the result's `pid`); with spy,
    the rows it commits are logged there (COMMIT_SPY)."""
    full_env = dict(os.environ, **(env or {}))
    cmd = [sys.executable, "-m", "batchinfer.cli", *args]
    if spy is not None:
        cmd = [sys.executable, "-c", COMMIT_SPY, str(spy), *args]
    opts = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env, start_new_session=True)
    with subprocess.Popen(cmd, **opts, **kw) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            raise
    res = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    res.pid = proc.pid  # type: ignore[attr-defined]
    return res


def shm_entries() -> set[str]:
    """vLLM's shared-memory leftovers (psm_*, sem.mp-*)."""
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith(("psm_", "sem.mp-"))}
    except FileNotFoundError:
        return set()


@pytest.fixture
def clean_shm():
    """Remove /dev/shm entries that killed vLLM processes of this test left."""
    before = shm_entries()
    yield
    for name in shm_entries() - before:
        try:
            os.unlink(f"/dev/shm/{name}")
        except OSError:
            pass


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL a process group started with start_new_session."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=60)


def group_alive(pgid: int, wait: float = 10.0) -> list[int]:
    """Pids of a process group still running (zombies awaiting a reaper do not count)."""
    deadline = time.monotonic() + wait
    while True:
        pids = []
        for d in os.listdir("/proc"):
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                pids.append(int(d))
        if not pids or time.monotonic() > deadline:
            return pids
        time.sleep(0.2)


ROWS = 600  # the kill tests' corpus: many commits per shard


@pytest.fixture(scope="session")
def workload(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path, engine: Any) -> dict[str, Any]:
    """A corpus big enough for many commits per shard, and its uninterrupted output."""
    from batchinfer.config.compose import compose
    from batchinfer.launch.local import run_local

    d = tmp_path_factory.mktemp("kill")
    corpus = d / "corpus.jsonl"
    rows = write_corpus(corpus, ROWS, seed=7)
    base = [
        f"input.path={corpus}",
        "input.id_column=id",
        "sampling.max_tokens=24",
        "sharding.num_shards=2",
        "output.commit_every_rows=16",
        *model_overrides(tiny_model_path),
    ]
    clean = read_output(run_local(compose([*base, f"output.dir={d}/clean"]), engine=engine).path)
    assert_exactly_once(clean, rows)
    return {"base": base, "rows": rows, "clean": clean, "dir": d}


def resume_and_check(workload: dict[str, Any], out: Path, engine: Any) -> None:
    """Finish the run in-process and compare with the uninterrupted run, row for row; the rows
    committed before are unchanged after it and only the rows in none of them were redone."""
    from batchinfer.config.compose import compose
    from batchinfer.launch.local import run_local

    before = committed_rows(out)
    with recorded_commits() as redone:
        run = run_local(compose([*workload["base"], f"output.dir={out}"]), engine=engine)
    rows = read_output(run.path)
    assert_exactly_once(rows, workload["rows"])
    assert project(rows) == project(workload["clean"])
    assert_only_missing_rows_redone(out, before, redone, len(workload["rows"]))


def committed_rows(out: Path) -> dict[int, Any]:
    """Every committed row of a run directory: its JSON line's bytes (JSONL parts) or its record,
    from the parts or, once a shard is finished, the compacted file DONE.json names."""
    from batchinfer.rundir.store import RunDir, read_table

    run = RunDir(out)
    if not run.exists():
        return {}
    rows: dict[int, Any] = {}
    for shard in run.shards():
        for p in run.parts(shard.index):
            if p.suffix == ".jsonl":
                found = [(json.loads(line)["row"], line) for line in p.read_bytes().splitlines() if line.strip()]
            else:
                found = [(r["row"], r) for r in read_table(p, run.schema).to_pylist()]
            for row, value in found:
                assert row not in rows, f"row {row} committed twice ({p})"
                rows[row] = value
    return rows


@contextlib.contextmanager
def recorded_commits() -> Iterator[list[int]]:
    """The rows this process commits meanwhile (RunDir.write_part spied on), in commit order."""
    from batchinfer.rundir.store import RunDir

    real = RunDir.write_part
    rows: list[int] = []

    def spy(self: Any, index: int, table: Any) -> Any:
        path = real(self, index, table)
        rows.extend(table.column("row").to_pylist())
        return path

    RunDir.write_part = spy  # type: ignore[method-assign]
    try:
        yield rows
    finally:
        RunDir.write_part = real  # type: ignore[method-assign]


# `batchinfer` in a subprocess with RunDir.write_part spied on: each committed part's rows are
# appended to argv[1] as a JSON line (what a resume redid, even after compaction removed its parts).
COMMIT_SPY = """
import json, sys
from batchinfer.rundir.store import RunDir
real = RunDir.write_part
def spy(self, index, table):
    path = real(self, index, table)
    with open(sys.argv[1], "a") as f:
        f.write(json.dumps(table.column("row").to_pylist()) + "\\n")
    return path
RunDir.write_part = spy
from batchinfer.cli import main
sys.exit(main(sys.argv[2:]))
"""


def spied_rows(log: Path) -> list[int]:
    """Rows a COMMIT_SPY subprocess committed."""
    return [r for line in log.read_text().splitlines() for r in json.loads(line)] if log.exists() else []


def assert_only_missing_rows_redone(out: Path, before: dict[int, Any], redone: list[int], total: int) -> None:
    """Rows committed before a resume are unchanged (JSON lines byte for byte) and the resume
    committed exactly the rest, each once."""
    after = committed_rows(out)
    assert {r: after.get(r) for r in before} == before
    assert sorted(redone) == sorted(set(range(total)) - set(before))  # each missing row once


def assert_engine_output_kept_apart(out: Path, stderr: str) -> None:
    """vLLM's start-up lines went to DIR/logs/engine-*.log, not the console, and its engine ran in
    the dtype `auto` means on this CPU, recorded in DIR/dtype.json and each DONE.json."""
    from batchinfer.engine.dtype import own_choice

    own = own_choice()["dtype"]
    logs = "".join(p.read_text() for p in out.glob("logs/engine-*.log"))
    assert f"'dtype': '{own}'" in logs  # vLLM's "non-default args" line, at INFO in the file
    assert "Passing raw prompts" not in logs  # requests go through vLLM's renderer
    assert not re.search(r"(INFO|WARNING) \d\d-\d\d \d\d:", stderr)  # no vLLM log line on the console
    assert "Triton" not in stderr and "engine output goes to" in stderr
    assert json.loads((out / "dtype.json").read_text())["dtype"] == own
    assert {json.loads(p.read_text())["model"]["dtype"] for p in out.glob("shards/*/DONE.json")} == {own}


def committed_parts_are_whole(out: Path) -> int:
    """Every visible part reads back in full; returns the committed row count."""
    from batchinfer.rundir.store import RunDir, read_table

    run = RunDir(out)
    total = 0
    for shard in run.shards():
        for p in run.parts(shard.index):
            total += read_table(p, run.schema).num_rows
    return total
