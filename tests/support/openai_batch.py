"""OpenAI Batch API input files and runs of them on the shared engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from batchinfer.config.compose import compose
from batchinfer.launch.local import run_local
from support.runs import model_overrides


def request(custom_id: str, body: dict[str, Any], url: str = "/v1/chat/completions") -> str:
    """One line of an OpenAI Batch input file."""
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body}) + "\n"


def run_batch(tmp: Path, model: Path, engine: Any, lines: str) -> list[dict]:
    """Run an OpenAI Batch file of these lines on the shared engine; its output lines."""
    (tmp / "batch.jsonl").write_text(lines)
    ov = [f"input.path={tmp}/batch.jsonl", f"output.dir={tmp}/run", "sampling.max_tokens=5", *model_overrides(model)]
    run = run_local(compose(ov), engine=engine)
    assert run.output_path.name == "output.jsonl"
    return [json.loads(line) for line in run.output_path.read_text().splitlines()]
