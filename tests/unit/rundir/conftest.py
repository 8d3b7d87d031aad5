"""Fixtures of the run-directory tests: both part formats, and an uninterrupted run to compare with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support.parts import committed, finish_all

from batchinfer.rundir.merge import merge


@pytest.fixture(params=["parquet", "jsonl"])
def fmt(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def reference(tmp_path: Path, fmt: str) -> dict[str, Any]:
    """The uninterrupted run: the run, its compacted files and merged output."""
    run = committed(tmp_path, "reference", fmt)
    finish_all(run)
    files = {s.index: run.shard_folder(s.index).compacted().read_bytes() for s in run.shards()}  # type: ignore[union-attr]
    merge(run)
    return {"run": run, "compacted": files, "output": run.output_path.read_bytes()}
