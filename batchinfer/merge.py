"""Verify every shard is complete and write the output in input order, each row exactly once."""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchinfer import faults
from batchinfer.data import Shard
from batchinfer.errors import RunDirError
from batchinfer.schema import table_to_jsonl
from batchinfer.store import TMP_PREFIX, RunDir, fsync_dir, read_json, write_json

log = logging.getLogger("batchinfer")


def format_indices(indices: list[int], limit: int = 20) -> str:
    """Short readable list of shard indices."""
    shown = ", ".join(str(i) for i in indices[:limit])
    return shown + (f", ... ({len(indices)} in all)" if len(indices) > limit else "")


def incomplete_shards(run: RunDir) -> list[int]:
    """Shards without DONE.json."""
    return [s.index for s in run.shards() if not run.is_done(s.index)]


def shard_rows_in_order(run: RunDir, shard: Shard) -> pa.Table:
    """A shard's committed rows sorted by row, checked to be exactly its range."""
    table = run.read_shard(shard.index)
    table = table.take(pc.sort_indices(table, sort_keys=[("row", "ascending")]))
    rows = table.column("row").to_numpy()
    if len(rows) != shard.rows or (
        len(rows) and (rows[0] != shard.start or rows[-1] != shard.stop - 1 or (rows[1:] - rows[:-1] != 1).any())
    ):
        seen = Counter(rows.tolist())
        dup = sorted(r for r, n in seen.items() if n > 1)[:5]
        missing = sorted(set(range(shard.start, shard.stop)) - set(seen))[:5]
        raise RunDirError(
            f"shard {shard.index}: committed rows do not match rows {shard.start}..{shard.stop - 1} "
            f"(duplicates {dup}, missing {missing}); the shard folder was changed by hand or by two writers"
        )
    return table


def merge(run: RunDir) -> dict[str, Any]:
    """Write DIR/output.* and DIR/stats.json; refuses, naming them, while shards are incomplete."""
    missing = incomplete_shards(run)
    if missing:
        raise RunDirError(
            f"{run.path}: {len(missing)} of {len(run.shards())} shards are incomplete "
            f"(shards {format_indices(missing)}); finish them with `batchinfer resume {run.path}` "
            f"or by running the same `batchinfer run` again, then merge"
        )
    t0 = time.monotonic()
    out = run.output_path
    tmp = out.with_name(TMP_PREFIX + out.name)
    stats: dict[str, Any] = {
        "rows": 0,
        "errors": Counter(),
        "finish_reasons": Counter(),
        "prompt_tokens": 0,
        "output_tokens": 0,
    }
    seconds: Counter[str] = Counter()
    shards = run.shards()
    writer = pq.ParquetWriter(tmp, run.schema, compression="zstd") if run.output_format == "parquet" else None
    openai = openai_writer(run) if run.output_format == "openai" else None
    with open(tmp, "wb") if writer is None else nullcontext() as f:
        for n, shard in enumerate(shards):
            table = shard_rows_in_order(run, shard)
            if writer is not None:
                writer.write_table(table)
            elif openai is not None:
                f.write(openai(shard, table))
            else:
                f.write(table_to_jsonl(table))
            _accumulate(stats, table)
            seconds.update(read_json(run.done_path(shard.index)).get("seconds", {}))
            if n == len(shards) // 2:
                faults.point("in-merge")
        if writer is not None:
            writer.close()
        else:
            f.flush()
            os.fsync(f.fileno())
    if writer is not None:
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
    os.replace(tmp, out)
    fsync_dir(out.parent)
    stats.update(
        shards=len(shards),
        output=out.name,
        errors=dict(stats["errors"]),
        finish_reasons=dict(stats["finish_reasons"]),
        seconds=dict(seconds),
        merge_seconds=round(time.monotonic() - t0, 3),
        fingerprint=run.run["fingerprint"],
    )
    write_json(run.stats_json, stats)
    log.info("merged %d rows from %d shards into %s", stats["rows"], len(shards), out)
    return stats


def openai_writer(run: RunDir) -> Callable[[Shard, pa.Table], bytes]:
    """Lines of the OpenAI Batch output format for a shard's rows (the request's url from DIR/input)."""
    from batchinfer.data import open_input
    from batchinfer.openai_batch import CHAT_URL, response_line

    urls = open_input(run.input_dir).data.column("url") if run.run["input"]["format"] == "openai" else None
    model = run.run["config"]["model"]["path"]
    tag = run.run["fingerprint"][:12]
    created = int(time.time())

    def lines(shard: Shard, table: pa.Table) -> bytes:
        shard_urls = urls.slice(shard.start, shard.rows).to_pylist() if urls is not None else [CHAT_URL] * shard.rows
        out = [
            json.dumps(response_line(row, url, model, tag, created), ensure_ascii=False)
            for row, url in zip(table.to_pylist(), shard_urls, strict=True)
        ]
        return ("\n".join(out) + "\n").encode()

    return lines


def _accumulate(stats: dict[str, Any], table: pa.Table) -> None:
    stats["rows"] += table.num_rows
    stats["prompt_tokens"] += int(pc.sum(table.column("prompt_tokens")).as_py() or 0)
    stats["output_tokens"] += int(pc.sum(table.column("output_tokens")).as_py() or 0)
    stats["errors"].update(e["kind"] for e in table.column("error").to_pylist() if e)
    stats["finish_reasons"].update(r for r in table.column("finish_reason").to_pylist() if r)
