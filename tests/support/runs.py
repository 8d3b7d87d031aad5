"""Runs on the tiny model and what they commit: overrides, committed rows and parts, resume checks."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from support.corpus import assert_exactly_once, project, read_output

# One engine config for every in-process test, so they can share the session engine.
ENGINE_OVERRIDES = ["model.enforce_eager=true", "model.max_model_len=128", "model.max_num_seqs=16"]


ROWS = 600  # the kill tests' corpus: many commits per shard


@dataclass
class Workload:
    """The kill tests' corpus, its overrides and uninterrupted output on one engine (the real one or
    the stand-in), and what a subprocess needs in its environment to run that engine."""

    base: list[str]  # overrides without output.dir
    rows: list[dict]  # the input rows
    clean: list[dict]  # the output of an uninterrupted run
    dir: Path  # where the tests put their run directories
    engine: Any  # the in-process engine that made `clean`, for resumes
    env: dict[str, str] = field(default_factory=dict)  # for `batchinfer` subprocesses (run_cli's env)


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


def resume_and_check(workload: Workload, out: Path, engine: Any = None) -> None:
    """Finish the run in-process and compare with the uninterrupted run, row for row; the rows
    committed before are unchanged after it and only the rows in none of them were redone."""
    from batchinfer.config.compose import compose
    from batchinfer.launch.local import run_local

    before = committed_rows(out)
    with recorded_commits() as redone:
        run = run_local(compose([*workload.base, f"output.dir={out}"]), engine=engine or workload.engine)
    rows = read_output(run.path)
    assert_exactly_once(rows, workload.rows)
    assert project(rows) == project(workload.clean)
    assert_only_missing_rows_redone(out, before, redone, len(workload.rows))


def committed_rows(out: Path) -> dict[int, Any]:
    """Every committed row of a run directory: its JSON line's bytes (JSONL parts) or its record,
    from the parts or, once a shard is finished, the compacted file DONE.json names."""
    from batchinfer.rundir.store import RunDir
    from batchinfer.rundir.tables import read_table

    run = RunDir(out)
    if not run.exists():
        return {}
    rows: dict[int, Any] = {}
    for shard in run.shards():
        for p in run.shard_folder(shard.index).committed_files():
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
    """The rows this process commits meanwhile (ShardFolder.write_part spied on), in commit order."""
    from batchinfer.rundir.shard_folder import ShardFolder

    real = ShardFolder.write_part
    rows: list[int] = []

    def spy(self: Any, table: Any) -> Any:
        path = real(self, table)
        rows.extend(table.column("row").to_pylist())
        return path

    ShardFolder.write_part = spy  # type: ignore[method-assign]
    try:
        yield rows
    finally:
        ShardFolder.write_part = real  # type: ignore[method-assign]


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
    from batchinfer.rundir.store import RunDir
    from batchinfer.rundir.tables import read_table

    run = RunDir(out)
    total = 0
    for shard in run.shards():
        for p in run.shard_folder(shard.index).committed_files():
            total += read_table(p, run.schema).num_rows
    return total
