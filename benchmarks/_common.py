"""Pieces several benchmarks share (run from benchmarks/: `python benchmarks/x.py`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq


def prepared_run(root: Path, rows: int, fmt: str, sharding: str) -> tuple[Any, pa.Array]:
    """A run directory over `rows` rows of a Parquet corpus referenced in place (ids
    doc-00000000...), with a config.json-only model: returns the RunDir and the ids."""
    from batchinfer.config.compose import compose
    from batchinfer.rundir.prepare import prepare

    corpus = root / "corpus.parquet"  # referenced in place by prepare, not converted
    ids = pa.array([f"doc-{i:08d}" for i in range(rows)])
    pq.write_table(pa.table({"id": ids, "text": pa.array(["x"] * rows)}), corpus)
    model = root / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    overrides = [f"input.path={corpus}", "input.id_column=id", f"model.path={model}", sharding]
    run = prepare(compose([*overrides, f"output.format={fmt}", f"output.dir={root / 'run'}"]))
    return run, ids
