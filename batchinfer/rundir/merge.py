"""Verify every shard is complete and write the output in input order, each row exactly once."""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from batchinfer import faults
from batchinfer.durable import TMP_PREFIX, read_json, refused_write, storage_error, write_json
from batchinfer.errors import RunDirError
from batchinfer.locks import RunLock
from batchinfer.logs import plural
from batchinfer.rundir.ordered_rows import shard_rows_in_order
from batchinfer.rundir.output_swap import MERGING, check_own_output, put_in_place, remove_merge_leftovers
from batchinfer.rundir.output_writer import OutputWriter, to_datasets_folder
from batchinfer.rundir.passes import is_pass, root_of
from batchinfer.rundir.splice import Splicer, unchanged_output
from batchinfer.rundir.stats import MergeStats
from batchinfer.rundir.store import RunDir
from batchinfer.security import private_umask, remove_path

log = logging.getLogger("batchinfer")


def format_indices(indices: list[int], limit: int = 20) -> str:
    """Short readable list of shard indices."""
    shown = ", ".join(str(i) for i in indices[:limit])
    return shown + (f", ... ({len(indices)} in all)" if len(indices) > limit else "")


def incomplete_shards(run: RunDir) -> list[int]:
    """Shards without DONE.json."""
    return [s.index for s in run.shards() if not run.shard_folder(s.index).is_done()]


def merge(run: RunDir) -> MergeStats:
    """Write DIR/output* and DIR/stats.json; refuses, naming them, while shards are incomplete."""
    output = run.recorded_config.output
    with private_umask(output.private):
        # One merge at a time (a merge job and a `batchinfer merge` typed meanwhile): the second
        # is refused naming the first, instead of renaming the other's half-written file.
        with RunLock(run.path, log=log.warning, mode=output.lock):
            remove_merge_leftovers(run)
            stats = unchanged_output(run) or _merge(run)
    if is_pass(run):  # a finished pass (redo) goes into its run directory's output
        merge(root_of(run))
    return stats


def _merge(run: RunDir) -> MergeStats:
    missing = incomplete_shards(run)
    if missing:
        raise RunDirError(
            f"{run.path}: {len(missing)} of {len(run.shards())} shards are incomplete "
            f"(shards {format_indices(missing)}); finish them with `batchinfer resume {run.path}` "
            f"or by running the same `batchinfer run` again, then merge"
        )
    t0 = time.monotonic()
    out = run.output_path
    check_own_output(run, out)
    # A name of this merge's own: a merge that did not hold the lock (an older version) cannot
    # rename our half-written file into place, nor we its.
    tmp = out.with_name(f"{TMP_PREFIX}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}-{out.name}")
    tally = Tally()
    seconds: Counter[str] = Counter()
    shards = run.shards()
    splice = Splicer(run)  # answers of finished passes (redo) in place of DIR's own
    try:
        writer = OutputWriter(run, tmp, splice.schema)
        for n, shard in enumerate(shards):
            folder = run.shard_folder(shard.index)
            done = read_json(folder.done_path)
            # under the run lock, DONE.json written: no writer is compacting this shard any more
            folder.remove_compaction_leftovers(done)
            for rows in splice(shard_rows_in_order(run, shard, done)):
                writer.write(rows)
                tally.add(rows.table)
            seconds.update(done.get("seconds", {}))
            if n == len(shards) // 2:
                faults.point(faults.IN_MERGE)
        files = writer.close()
        if run.output_format == "hf":
            files = to_datasets_folder(tmp, files)
        faults.point(faults.BEFORE_MERGE_RENAME)
        # What this merge puts in place, on record before it is there: a merge killed between the
        # rename and stats.json leaves this, and the next one knows the output is its own.
        names = [str(f.relative_to(tmp)) for f in files] if out.name == "output" else [out.name]
        write_json(run.path / MERGING, {"output": out.name, "files": names})
        put_in_place(tmp, out)
    except OSError as e:
        if refused_write(e) is None:
            raise
        try:
            remove_path(tmp)
        except OSError:
            pass
        raise storage_error(out, e) from None
    stats = MergeStats(
        rows=tally.rows,
        errors=dict(tally.errors),
        finish_reasons=dict(tally.finish_reasons),
        prompt_tokens=tally.prompt_tokens,
        output_tokens=tally.output_tokens,
        shards=len(shards),
        output=out.name,
        files=names,
        seconds=dict(seconds),
        merge_seconds=round(time.monotonic() - t0, 3),
        fingerprint=run.run["fingerprint"],
        **splice.stats(),
    )
    write_json(run.stats_json, stats)
    (run.path / MERGING).unlink()
    log.info("merged %s from %s into %s", plural(stats["rows"], "row"), plural(len(shards), "shard"), out)
    return stats


@dataclass
class Tally:
    """The output's counts as merge writes it: rows, error rows and finish reasons by kind, tokens."""

    rows: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    finish_reasons: Counter[str] = field(default_factory=Counter)
    prompt_tokens: int = 0
    output_tokens: int = 0

    def add(self, table: pa.Table) -> None:
        """Add rows' counts, column-wise (no Python object per row)."""
        self.rows += table.num_rows
        if "prompt_tokens" in table.column_names:
            self.prompt_tokens += int(pc.sum(table.column("prompt_tokens")).as_py() or 0)
        if "output_tokens" in table.column_names:
            self.output_tokens += int(pc.sum(table.column("output_tokens")).as_py() or 0)
        if "error" in table.column_names:
            _count(self.errors, pc.struct_field(table.column("error"), "kind"))
        if "finish_reason" in table.column_names:
            _count(self.finish_reasons, table.column("finish_reason"))


def _count(counter: Counter[str], values: pa.ChunkedArray) -> None:
    for item in pc.value_counts(values).to_pylist():
        if item["values"]:  # nulls (no error, no finish reason) and empty strings are not counted
            counter[item["values"]] += item["counts"]
