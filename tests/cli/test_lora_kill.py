"""SIGKILL in the middle of a shard of three LoRA adapters and base-model rows (a real `batchinfer
run` subprocess with its engine), then the same run again (in this process, on the shared LoRA
engine): every row exactly once and as an uninterrupted run answers it, the rows committed before
the kill byte for byte as they were."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest
from conftest import lora_overrides
from support.corpus import project, read_output, write_corpus, write_rows
from support.procs import group_alive, run_cli
from support.runs import (
    assert_only_missing_rows_redone,
    committed_parts_are_whole,
    committed_rows,
    model_overrides,
    recorded_commits,
)

from batchinfer.config.compose import compose
from batchinfer.launch.local import run_local

pytestmark = [pytest.mark.engine, pytest.mark.kill]

ROWS = 160  # 2 shards of 80 rows, a part every 16


def test_sigkill_during_a_multi_adapter_shard_then_the_same_run(
    tmp_path: Path, tiny_model_path: Path, tiny_adapters: dict[str, Path], lora_engine: Any, clean_shm: None
) -> None:
    names = ["a1", None, "a3", "a2", "a2", None, "a1", "a3"]
    rows = [dict(r, task=names[i % len(names)]) for i, r in enumerate(write_corpus(tmp_path / "w.jsonl", ROWS, seed=9))]
    corpus = write_rows(tmp_path / "c.jsonl", rows)
    base = [
        f"input.path={corpus}",
        "input.id_column=id",
        "input.adapter_column=task",
        "sampling.max_tokens=24",
        "sharding.num_shards=2",
        "output.commit_every_rows=16",
        "output.format=jsonl",  # committed rows compared as the bytes of their lines
        *model_overrides(tiny_model_path),
        *lora_overrides(tiny_adapters),
    ]
    clean = read_output(run_local(compose([*base, f"output.dir={tmp_path}/clean"]), engine=lora_engine).path)
    assert [r["adapter"] for r in clean] == [r["task"] for r in rows] and all(r["error"] is None for r in clean)

    out = tmp_path / "killed"
    res = run_cli(["run", *base, f"output.dir={out}"], env={"BATCHINFER_FAULT": "in-generate:60"})
    assert res.returncode == -signal.SIGKILL, res.stderr[-3000:]
    assert group_alive(res.pid) == []  # the engine's processes died with it
    committed = committed_parts_are_whole(out)
    assert 0 < committed < ROWS, committed  # killed inside the first shard, after some parts
    before = committed_rows(out)
    adapters_before = {r: json.loads(line)["adapter"] for r, line in before.items()}
    assert len(set(adapters_before.values())) >= 2  # the parts hold rows of several adapters

    with recorded_commits() as redone:
        run = run_local(compose([*base, f"output.dir={out}"]), engine=lora_engine)
    again = read_output(run.path)
    assert [r["row"] for r in again] == list(range(ROWS)) and [r["id"] for r in again] == [r["id"] for r in rows]
    assert project(again) == project(clean) and [r["adapter"] for r in again] == [r["adapter"] for r in clean]
    assert_only_missing_rows_redone(out, before, redone, ROWS)  # committed lines unchanged, the rest once
