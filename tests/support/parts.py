"""Run directories committed as a worker commits them, without an engine (compaction and merge tests)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from batchinfer.config.compose import compose
from batchinfer.durable import write_json
from batchinfer.locks import ShardLock
from batchinfer.rundir.prepare import prepare
from batchinfer.rundir.schema import error_row, rows_to_table
from batchinfer.rundir.store import RunDir
from support.corpus import write_corpus
from support.runs import fake_model_dir

ROWS, SHARDS = 24, 2
DONE = {"rows_done": ROWS // SHARDS, "seconds": {"generate": 1.5, "commit": 0.25}, "output_tokens": 7}


def output_row(run: RunDir, r: int) -> dict[str, Any]:
    """A row as a worker commits it: text, finish reason and tokens, every fifth an error row (no
    request: no digest), a request digest otherwise."""
    if r % 5 == 3:
        row = error_row(r, f"doc-{r:05d}", "prompt", f"row {r}: too long", prompt_tokens=300)
        return dict(row, request_digest=None, reused=None)
    return {
        "row": r,
        "id": f"doc-{r:05d}",
        "text": f"answer {r} é \u2028 {'x' * (r % 7)}",
        "finish_reason": "length" if r % 4 == 0 else "stop",
        "prompt_tokens": 10 + r,
        "output_tokens": r % 6,
        "error": None,
        "request_digest": f"{r:032x}",
        "reused": r % 2 == 0,
    }


def committed(tmp_path: Path, name: str, fmt: str, shards: int = SHARDS, rows: int = ROWS, *extra: str) -> RunDir:
    """A run directory whose every row is committed in parts, in a shuffled commit order (as a worker
    orders work by prompt length), with progress.json; no DONE.json yet."""
    corpus = tmp_path / "corpus.jsonl"
    if not corpus.exists():
        write_corpus(corpus, rows)
    run = prepare(
        compose(
            [
                f"input.path={corpus}",
                "input.id_column=id",
                f"model.path={fake_model_dir(tmp_path)}",
                f"output.dir={tmp_path / name}",
                f"output.format={fmt}",
                f"sharding.num_shards={shards}",
                *extra,
            ]
        )
    )
    for shard in run.shards():
        order = list(range(shard.start, shard.stop))
        random.Random(shard.index).shuffle(order)
        run.shard_dir(shard.index).mkdir(parents=True, exist_ok=True)
        for start in range(0, len(order), 5):
            run.shard_folder(shard.index).write_part(
                rows_to_table([output_row(run, r) for r in order[start : start + 5]], run.schema)
            )
        write_json(run.shard_folder(shard.index).progress_path, {"rows_done": shard.rows, "output_tokens": 7})
    return run


def finish_all(run: RunDir) -> None:
    """Finish every shard as a worker does (the uninterrupted run)."""
    for shard in run.shards():
        with ShardLock(run.shard_dir(shard.index), mode=run.config.output.lock, log=lambda m: None):
            run.shard_folder(shard.index).finish(DONE)
