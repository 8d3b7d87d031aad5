"""examples/stdlib-search end to end through real vLLM: the standard library's docstrings embedded
by all-MiniLM-L6-v2 (task=embed), nearest neighbours printed from the merged Parquet."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from support import REPO

RUN = "bash examples/stdlib-search/run.sh"
QUERIES = ("bisect.insort_left", "base64.b64encode")


def expected_table(output: Path, queries: tuple[str, ...], top: int = 5) -> list[str]:
    """The neighbour lines show.py should print, computed here from the rows as Python lists."""
    rows = pq.read_table(output).to_pylist()
    ids = [r["id"] for r in rows]
    m = np.array([r["embedding"] for r in rows], dtype=np.float64)
    m /= np.linalg.norm(m, axis=1, keepdims=True)
    lines = []
    for q in queries:
        cos = {ids[j]: float(m[ids.index(q)] @ m[j]) for j in range(len(ids)) if ids[j] != q}
        near = sorted(cos, key=lambda k: -cos[k])[:top]
        lines.append(f"| `{q}` | " + ", ".join(f"`{n}` {cos[n]:.2f}" for n in near) + " |")
    return lines


@pytest.mark.engine
def test_search_example_runs_on_a_few_rows(tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = dict(os.environ, EXAMPLE_ROWS="26", EXAMPLE_OUT=str(out), EXAMPLE_QUERY=" ".join(QUERIES))
    res = subprocess.run(RUN, shell=True, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "26 functions embedded (384 dimensions)" in res.stdout
    corpus = [json.loads(line) for line in (tmp_path / "run.input" / "functions.jsonl").open()]
    rows = pq.read_table(out / "output.parquet").to_pylist()
    assert [r["id"] for r in rows] == [c["id"] for c in corpus] and len(rows) == 26
    assert all(r["error"] is None and len(r["embedding"]) == 384 for r in rows)
    assert np.allclose(np.linalg.norm([r["embedding"] for r in rows], axis=1), 1.0, atol=1e-5)
    table = expected_table(out / "output.parquet", QUERIES)
    printed = [line for line in res.stdout.splitlines() if line.startswith("| `")]
    assert printed == table
    # the docstrings say insort_left and insort_right do the same thing; no bisect function is
    # near an encoder of base64
    assert table[0].startswith("| `bisect.insort_left` | `bisect.insort_right` 0.9")
    assert "bisect." not in table[1]
    again = subprocess.run(RUN, shell=True, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "is already complete: 26 rows" in again.stdout
    assert [line for line in again.stdout.splitlines() if line.startswith("| `")] == table
