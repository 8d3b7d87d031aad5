"""The README's two commands: the example runs as documented, and CI runs the documented test command."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from support import REPO


def quickstart_commands() -> list[str]:
    """The command lines of the README's Quickstart block."""
    text = (REPO / "README.md").read_text()
    block = re.search(r"## Quickstart.*?```bash\n(.*?)```", text, re.S).group(1)
    return [ln for ln in block.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def test_readme_names_the_two_commands_and_ci_runs_the_second() -> None:
    install_and_example, tests = quickstart_commands()
    assert install_and_example == "bash scripts/install-cpu.sh && bash examples/stdlib-topics/run.sh"
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert tests in ci  # exactly the same test command


@pytest.mark.engine
def test_readme_example_runs_on_a_few_rows(tmp_path: Path) -> None:
    example = quickstart_commands()[0].split(" && ")[1]
    env = dict(os.environ, EXAMPLE_ROWS="12", EXAMPLE_OUT=str(tmp_path / "run"))
    res = subprocess.run(example, shell=True, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "12 functions labelled; errors: 0" in res.stdout
    rows = pq.read_table(tmp_path / "run" / "output.parquet").to_pylist()
    ids = [line.split('"id": "')[1].split('"')[0] for line in (tmp_path / "run.input" / "functions.jsonl").open()]
    assert [r["id"] for r in rows] == ids and len(ids) == 12
    topics = yaml.safe_load((REPO / "examples/stdlib-topics/conf/sampling/stdlib-topics.yaml").read_text())
    allowed = set(topics["structured_outputs"]["choice"])
    assert all(r["text"] in allowed and r["error"] is None for r in rows)
    again = subprocess.run(example, shell=True, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "is already complete: 12 rows" in again.stdout
