"""DIR's rows with its finished passes' answers put in place (each row from the latest pass that
answered it, a `pass` column saying which), streamed in input order: what merge writes and what
`redo --where` selects from; and a pass's input made of the selected rows."""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchinfer.durable import publish_stream
from batchinfer.errors import RunDirError
from batchinfer.rundir.ordered_rows import Rows, shard_rows_in_order
from batchinfer.rundir.passes import (
    MERGED_PASSES,
    PASS_COLUMN,
    PASS_FIELD,
    SELECTION,
    SOURCE_ROW,
    finished_passes,
    output_is_current,
    source_rows,
    unfinished_pass,
    with_pass_column,
)
from batchinfer.rundir.schema import jsonl_to_table
from batchinfer.rundir.stats import MergeStats, PassCounts
from batchinfer.rundir.store import RunDir

log = logging.getLogger("batchinfer")


class _PassCursor:
    """One finished pass's answers in input order, their `row` and `pass` set to DIR's."""

    def __init__(self, run: RunDir, number: int, schema: pa.Schema):
        self.run, self.number, self.schema = run, number, schema
        self.sources = source_rows(run)
        self.pieces = (p.table for s in run.shards() for p in shard_rows_in_order(run, s))
        self.pending: Optional[pa.Table] = None

    def _next(self) -> Optional[pa.Table]:
        table = next(self.pieces, None)
        if table is None:
            return None
        # selection.parquet is in input order, so the pass's rows in its own order are in DIR's too
        rows = pa.array(self.sources[table.column("row").to_numpy()], pa.int64())
        table = table.set_column(table.schema.get_field_index("row"), "row", rows)
        number = pa.array(np.full(table.num_rows, self.number, np.int32))
        return table.append_column(PASS_FIELD, number)

    def until(self, stop: int) -> Optional[pa.Table]:
        """The pass's answers for rows below stop (those not taken yet)."""
        taken = []
        while True:
            if self.pending is None:
                self.pending = self._next()
                if self.pending is None:
                    break
            rows = self.pending.column("row").to_numpy()
            n = int(np.searchsorted(rows, stop))
            taken.append(self.pending.slice(0, n))
            if n < self.pending.num_rows:
                self.pending = self.pending.slice(n)
                break
            self.pending = None
        taken = [t for t in taken if t.num_rows]
        return pa.concat_tables(taken) if taken else None


class Splicer:
    """Wraps DIR's own rows (merge's stream) with the finished passes' answers in place; counts
    rows per pass. Without a finished pass the stream is passed through unchanged."""

    def __init__(self, root: RunDir, passes: Optional[list[RunDir]] = None, always: bool = False):
        self.root = root
        self.passes = finished_passes(root) if passes is None else passes
        self.active = bool(self.passes) or always
        self.schema = with_pass_column(root.schema) if self.active else root.schema
        self.cursors = [_PassCursor(p, int(p.path.name), self.schema) for p in self.passes]
        self.counts: Counter[int] = Counter()

    def __call__(self, pieces: Iterator[Rows]) -> Iterator[Rows]:
        """The pieces with passes' answers in place (full tables with the pass column)."""
        if not self.active:
            yield from pieces
            return
        for piece in pieces:
            table = piece.table if piece.lines is None else jsonl_to_table(piece.lines, self.root.schema)
            table = table.append_column(PASS_FIELD, pa.array(np.zeros(table.num_rows, np.int32)))
            if table.num_rows:
                stop = int(table.column("row")[-1].as_py()) + 1
                for cursor in self.cursors:
                    answers = cursor.until(stop)
                    if answers is not None:
                        table = self._put(table, answers, cursor.run)
            for item in pc.value_counts(table.column(PASS_COLUMN)).to_pylist():
                self.counts[item["values"]] += item["counts"]
            yield Rows(table)

    def _put(self, table: pa.Table, answers: pa.Table, run: RunDir) -> pa.Table:
        """table with answers in place of the rows they answer (ids kept: DIR's)."""
        rows = table.column("row").to_numpy()
        wanted = answers.column("row").to_numpy()
        at = np.searchsorted(rows, wanted)
        if (at >= len(rows)).any() or (rows[np.minimum(at, len(rows) - 1)] != wanted).any():
            raise RunDirError(
                f"{run.path}: holds rows its run directory does not have, or out of order; the pass folder was changed by hand"
            )
        answers = answers.set_column(answers.schema.get_field_index("id"), "id", table.column("id").take(pa.array(at)))
        answers = answers.select(self.schema.names).cast(self.schema)
        index = np.arange(len(rows))
        index[at] = len(rows) + np.arange(len(wanted))
        return pa.concat_tables([table, answers]).take(pa.array(index))

    def stats(self) -> PassCounts:
        """stats.json's `passes`: rows of the output per pass (`0`: DIR's own run), and `merged_passes`:
        the passes this merge took (one whose every row a later pass answered again has no rows,
        yet is merged); nothing without passes."""
        if not self.passes:
            return {}
        return {
            "passes": {str(k): v for k, v in sorted(self.counts.items())},
            MERGED_PASSES: [int(p.path.name) for p in self.passes],
        }


def unchanged_output(root: RunDir) -> Optional[MergeStats]:
    """stats.json when a pass is not finished and DIR's output holds every pass before it: merge
    leaves that output as it is."""
    number = unfinished_pass(root)
    if number is None or not output_is_current(root):
        return None
    log.warning(
        "pass %d of %s is not finished: %s stays as merged before it (`batchinfer resume %s` finishes it)",
        number,
        root.path,
        root.output_path,
        root.path,
    )
    return dict(root.stats() or {}, unchanged=f"pass {number} is not finished")


def merged_view(root: RunDir) -> Iterator[pa.Table]:
    """DIR's rows as merged now, with the pass column: the output file when it is current and
    Parquet, else the committed parts of DIR and its finished passes."""
    out = root.output_path
    if root.output_format == "parquet" and output_is_current(root):
        files = sorted(out.glob("*.parquet")) if out.is_dir() else [out]
        for path in files:
            with pq.ParquetFile(path) as f:
                for i in range(f.num_row_groups):
                    table = f.read_row_group(i)
                    if PASS_COLUMN not in table.column_names:  # an output merged before any pass
                        table = table.append_column(PASS_FIELD, pa.array(np.zeros(table.num_rows, np.int32)))
                    yield table
        return
    splicer = Splicer(root, always=True)
    for shard in root.shards():
        for rows in splicer(shard_rows_in_order(root, shard)):
            yield rows.table


def select_rows(root: RunDir, where: pc.Expression) -> np.ndarray:
    """Row numbers of DIR's merged rows that match the expression, ascending."""
    found = [t.filter(where).column("row").to_numpy() for t in merged_view(root)]
    return np.concatenate(found).astype(np.int64) if found else np.zeros(0, np.int64)


def view_schema(root: RunDir) -> pa.Schema:
    """The columns --where sees: DIR's output columns and `pass`."""
    return with_pass_column(root.schema)


def write_selection(root: RunDir, rows: np.ndarray, folder: Path, batch: int = 50_000) -> None:
    """folder/selection.parquet: the input rows of DIR at these row numbers, with SOURCE_ROW."""
    from batchinfer.inputs.convert import open_input

    ds = open_input(root.input_dir)

    def fill(f: BinaryIO) -> None:
        writer: Any = None
        try:
            for start in range(0, len(rows), batch):
                chunk = rows[start : start + batch]
                table = _with_absolute_images(root, ds, _input_rows(ds, chunk))
                if SOURCE_ROW in table.column_names:
                    raise RunDirError(
                        f"{root.path}: the input has a column {SOURCE_ROW!r}, which redo needs for itself"
                    )
                table = table.append_column(SOURCE_ROW, pa.array(chunk, pa.int64()))
                if writer is None:
                    writer = pq.ParquetWriter(f, table.schema, compression="zstd")
                writer.write_table(table)
        finally:
            if writer is not None:
                writer.close()

    target = folder / SELECTION
    publish_stream(target, fill, replace=target)  # a temporary, fsynced, renamed, the folder fsynced


def _with_absolute_images(root: RunDir, ds: Any, table: pa.Table) -> pa.Table:
    """The rows with their image paths absolute: relative ones start at DIR's input file's folder,
    and the pass's input (its selection) is in another folder. A column kept as JSON text is
    decoded first (the worker's values: image_cells) and written back as JSON text."""
    from batchinfer.requests.images import absolute_image_paths
    from batchinfer.rundir.image_cells import image_cells, image_column_of, is_json_text

    c = root.config
    column = image_column_of(c.prompt.image_column, table.column_names)
    if column is None or column not in table.column_names or not c.input.path:
        return table
    at = table.column_names.index(column)
    json_text = is_json_text(ds, column)
    cells = image_cells(table.column(at).to_pylist(), json_text)
    values = absolute_image_paths(cells, Path(c.input.path).expanduser().parent)
    if json_text:  # the column stays JSON text: the pass's worker decodes it as the run's did
        values = [json.dumps(v) if v is not None else None for v in values]
    return table.set_column(at, table.field(at), pa.array(values, table.field(at).type))


def _input_rows(ds: Any, rows: np.ndarray) -> pa.Table:
    """Input rows at these indices as a table: a referenced corpus reads only their row groups; a
    converted one is taken from its memory-mapped table (Dataset.select would write an indices
    cache into DIR/input)."""
    if hasattr(ds, "manifest"):
        return ds.select(rows.tolist()).table
    return ds.data.table.take(pa.array(rows))
