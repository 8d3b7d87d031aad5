"""An embed run SIGKILLed in a subprocess, then resumed: the committed vectors are kept byte for byte."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
from support.pooling import embed_corpus, minilm_overrides, plain_embed
from support.procs import group_alive, run_cli
from support.runs import assert_only_missing_rows_redone, committed_rows, recorded_commits

from batchinfer.config.compose import compose
from batchinfer.launch.local import run_local

pytestmark = [pytest.mark.engine]


def test_embed_kill_then_resume_keeps_committed_vectors(
    tmp_path: Path, minilm: Path, embed_engine: Any, clean_shm: None
) -> None:
    corpus = tmp_path / "c.jsonl"
    rows = embed_corpus(corpus, 400, seed=47)
    base = minilm_overrides(minilm, f"input.path={corpus}", "input.id_column=id", "output.commit_every_rows=32")
    out = tmp_path / "killed"
    # 16 sequences a step: many commits before the fault (max_num_seqs is not in the fingerprint)
    killed = [*base, "model.max_num_seqs=16", f"output.dir={out}"]
    res = run_cli(["run", *killed], env={"BATCHINFER_FAULT": "after-progress:3"})
    assert res.returncode == -signal.SIGKILL, res.stderr[-3000:]
    assert group_alive(res.pid) == []
    before = committed_rows(out)
    assert 0 < len(before) < len(rows) and not (out / "shards/00000/DONE.json").exists()  # partial
    with recorded_commits() as redone:
        run = run_local(compose([*base, f"output.dir={out}"]), engine=embed_engine)
    assert_only_missing_rows_redone(out, before, redone, len(rows))
    got = np.array(pq.read_table(run.output_path).column("embedding").to_pylist(), dtype=np.float32)
    clean = plain_embed(embed_engine, [r["text"] for r in rows])
    cosine = (got * clean).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(clean, axis=1)
    assert cosine.min() >= 0.9999, cosine.min()  # floats depend on batching, the vectors do not
