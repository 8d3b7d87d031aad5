"""The shards of one task on one engine: under each shard's lock, resume from its committed parts,
start the engine, stream the rest (scheduler.py), commit, seal; count a failed attempt."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from batchinfer import faults
from batchinfer.engine.crashes import crash_row
from batchinfer.engine.drafted import SliceDraft
from batchinfer.engine.generation import GenerationRows
from batchinfer.engine.phases import CLOCK
from batchinfer.engine.pooled import pooling_rows
from batchinfer.engine.reuse import RowReuse
from batchinfer.engine.rowbar import RowBar
from batchinfer.engine.scheduler import EngineLike, ShardScheduler, TaskRows
from batchinfer.engine.stopflag import StopFlag
from batchinfer.engine.stream import done_rows
from batchinfer.errors import BatchinferError, ConfigError, StorageError
from batchinfer.inputs.columns import get_path
from batchinfer.inputs.convert import open_input
from batchinfer.inputs.shards import Shard
from batchinfer.locks import ShardLock, configured_mode
from batchinfer.requests.build import row_id
from batchinfer.requests.image_budget import ImageBudget
from batchinfer.requests.prompts import PromptBuilder
from batchinfer.requests.request import ErrorRow, Made, RequestKey
from batchinfer.rundir.done import DoneRecord, Reproducibility, done_record
from batchinfer.rundir.model_record import check_model_unchanged
from batchinfer.rundir.progress import EngineSlot, PrefixCache, Progress, count_failure, read_progress, write_progress
from batchinfer.rundir.schema import REUSED_COLUMN, OutputRow, rows_to_table
from batchinfer.rundir.store import RunDir

log = logging.getLogger("batchinfer")


class ShardWorker:
    """Runs shards of one run directory on one (lazily started) engine."""

    def __init__(self, run: RunDir, get_engine: Callable[[], EngineLike], stop: StopFlag, bar: Optional[RowBar] = None):
        self.run = run
        self.cfg = run.config
        self.get_engine = get_engine
        self.stop = stop
        self.bar = bar
        self._dataset: Any = None
        self.device: Optional[str] = None  # set once this worker has an engine
        self.dtype: str = self.cfg.model.dtype  # the engine's, once it has one
        self.prompts = PromptBuilder(self.cfg.prompt)
        self.task_rows: TaskRows = pooling_rows(self.cfg, self.prompts) or GenerationRows(self.cfg, self.prompts)
        self._turns_checked = False
        self.reuse = RowReuse(run)  # request digests into the rows; output.reuse's answers
        self.record: Optional[Progress] = None  # the current shard's progress record
        self.failures: Optional[int] = None  # this shard's failures in this submission, once counted
        # {"index", "of", "devices"}: which of its task's engines this is (cluster.engines_per_task)
        self.engine_record: Optional[EngineSlot] = None
        self._engine_dead: Callable[[], bool] = lambda: False  # the engine's, once it has one
        self._model_checked = False
        # why the engine failed when another node caused it (an engine over several nodes); None: not
        self.node_fault: Callable[[], Optional[str]] = lambda: None

    @property
    def dataset(self) -> Any:
        """The converted input, memory-mapped once."""
        if self._dataset is None:
            self._dataset = open_input(self.run.input_dir)
        return self._dataset

    def run_shard(self, shard: Shard) -> DoneRecord:
        """Finish one shard (resuming from its committed parts) and return its DONE record."""
        sdir = self.run.shard_dir(shard.index)
        sdir.mkdir(parents=True, exist_ok=True)
        self.failures = None
        with ShardLock(sdir, mode=configured_mode(self.run.path), log=log.warning):
            try:
                return self._finish(shard)
            except Exception as e:
                if self.stop.signum is None and not isinstance(e, (BatchinferError, StorageError)):
                    self._count_failure(shard, e)
                raise

    def _finish(self, shard: Shard) -> DoneRecord:
        # Under the shard lock: what a killed writer left (temporaries, parts a finished shard's
        # compacted file replaces, a compacted file no DONE.json names) goes, finished or not.
        # DONE.json is read once: a second read (NFS negative lookup cache) could disagree with the
        # one the cleanup went by.
        folder = self.run.shard_folder(shard.index)
        sealed = folder.done_record()
        if folder.remove_temporaries_and_leftovers(sealed):
            log.info("shard %d: removed temporaries left by a killed writer", shard.index)
        if sealed is not None:
            return sealed
        self.record, committed = self._record_from_parts(shard)
        if len(committed):
            log.info("shard %d: resuming, %d of %d rows already committed", shard.index, len(committed), shard.rows)
        if np.count_nonzero((committed >= shard.start) & (committed < shard.stop)) < shard.rows:
            self._stream(shard, committed, self.record)
        faults.point(faults.BEFORE_DONE)
        done = done_record(self.record, time.time(), self._reproducibility())
        # Sealed only when the committed rows are exactly the shard's range (a later copy of a row
        # dropped); missing rows raise and leave the shard for resume.
        return folder.finish(done)

    def _reproducibility(self) -> Reproducibility:
        """What a reader needs to reproduce these rows: model, revision, settings, software, hardware."""
        return Reproducibility.here(self.cfg, self.dtype, self.device, self.engine_record)

    def _record_from_parts(self, shard: Shard) -> tuple[Progress, np.ndarray]:
        """The shard's record with counts rebuilt from its committed parts (the truth), attempts,
        failures and seconds carried over; and its committed rows (sorted)."""
        counted = [
            c for c in ("row", "prompt_tokens", "output_tokens", "error", REUSED_COLUMN) if c in self.run.schema.names
        ]
        folder = self.run.shard_folder(shard.index)
        table = folder.read_rows(columns=counted)  # pooling outputs have no output_tokens
        rows = done_rows(table.column("row"))  # sorted, so resume needs no set of a shard's rows
        counts = RowCounts.of(table)
        old = read_progress(folder.progress_path) or Progress(shard=shard.index)
        record = Progress(
            shard=shard.index,
            rows_total=shard.rows,
            rows_done=len(rows),
            parts=len(folder.committed_files()),
            prompt_tokens=counts.prompt_tokens,
            output_tokens=counts.output_tokens,
            errors=counts.errors,
            reused_rows=counts.reused_rows,
            attempts=old.attempts + 1,
            failures=old.failures,
            failures_by_job=old.failures_by_job or {},
            suspects={r: n for r, n in old.suspects.items() if not _contains(rows, r)},
            crashed=old.crashed,
            seconds=old.seconds,
            prefix_cache=old.prefix_cache,
            adapter_loads=old.adapter_loads,
            series=old.series,
        )
        return record, rows

    def _stream(self, shard: Shard, committed: np.ndarray, record: Progress) -> None:
        """Start the engine (unless a stop is pending) and stream the shard's remaining rows to it."""
        t0 = time.monotonic()
        # A stop already pending (it came while the parts were read, or between shards) is acted on
        # before the engine starts: a 15-40 s start would spend the warning Slurm gave.
        self.stop.check()
        if not self._model_checked:  # other weights at model.path now: refused before any row is answered
            check_model_unchanged(self.run)
            self._model_checked = True
        engine = self.get_engine()
        self.stop.check()  # a USR2 held pending while the engine started is delivered as it ends
        self._engine_dead = lambda: bool(getattr(engine, "dead", False))
        wake = getattr(engine, "wake_on", None)
        if wake is not None:  # vLLM's engine: a step that hangs returns when a stop is pending
            wake(lambda: self.stop.signum is not None)
        try:
            self._check_fixed_turns(engine)
            self.device = getattr(engine, "device", None)
            self.dtype = getattr(engine, "dtype", self.cfg.model.dtype)
            t_ready = time.monotonic()
            record.seconds.startup += t_ready - t0
            if self.bar is not None:
                self.bar.ready()  # the bar's clock starts once, when the engine is ready
            if record.prefix_cache is None and getattr(engine, "prefix_caching", False):
                record.prefix_cache = PrefixCache()
            ShardScheduler(self, shard, record, engine, committed, t_ready).run()
        finally:
            if wake is not None:  # a reused engine's later steps answer to their own worker's stop flag
                wake(lambda: False)

    def _check_fixed_turns(self, engine: EngineLike) -> None:
        """Render the config's own turns through the chat template once: a template that refuses
        them (a model without a system role) would make every row an error row."""
        p = self.cfg.prompt
        if self._turns_checked or not isinstance(self.task_rows, GenerationRows):
            return
        if p.mode != "chat" or not (p.system or p.examples):
            return
        try:
            engine.encode(self.prompts.fixed_turns(), p.chat_template_kwargs)
        except Exception as e:
            raise ConfigError(
                f"the model's chat template rejects the configured turns ({type(e).__name__}: {e}); "
                "unset prompt.system (or put it in prompt.template) or prompt.examples, or use prompt.mode=raw"
            ) from None
        self._turns_checked = True

    def requests(self, rows: list[tuple[int, dict[str, Any]]], engine: EngineLike) -> list[Made | Exception]:
        """Each (index, row)'s request (its output base and key), or its error row (a bad row), made
        together (one tokenizer call); what making one raised in its place."""
        draft = self.draft(rows, engine)
        draft.tokenize()
        return self.finish(draft, engine)

    def draft(
        self, rows: list[tuple[int, dict[str, Any]]], engine: EngineLike, images: Optional[ImageBudget] = None
    ) -> SliceDraft:
        """The first half of requests(): output bases, requests without tokens, prompts rendered;
        images decoded under `images` (the slice may end early: its `out` holds the rows made)."""
        out: list[Made | Exception] = []
        todo: list[tuple[int, OutputRow, dict[str, Any]]] = []  # (index, output base, row)
        places: list[int] = []
        with CLOCK("request"):
            for index, row in rows:
                try:
                    todo.append((index, {"row": index, "id": row_id(self.cfg, row, index), **self._carried(row)}, row))
                    places.append(len(out))
                    out.append(ErrorRow({}))  # its place, until made
                except Exception as e:  # raised where this row is taken
                    out.append(e)
        drafted = self.task_rows.draft(todo, engine, images)
        if len(drafted.rows) < len(todo):  # an image had no room: the slice ends before its row
            out, places = out[: places[len(drafted.rows)]], places[: len(drafted.rows)]
        return SliceDraft(out, places, drafted)

    def finish(self, draft: SliceDraft, engine: EngineLike) -> list[Made | Exception]:
        """The second half of requests(), once draft.tokenize() has counted the prompts' tokens."""
        made = self.task_rows.finish(draft.drafted, engine)
        with CLOCK("digest"):
            for k, (_, base, _), m in zip(draft.places, draft.drafted.rows, made, strict=True):
                try:
                    draft.out[k] = self.reuse.made(base, m, self.dtype) if isinstance(m, RequestKey) else m
                except Exception as e:
                    draft.out[k] = e
        return draft.out

    def _carried(self, row: dict[str, Any]) -> OutputRow:
        """The input columns carried into the output (input.columns), if any."""
        columns = self.cfg.input.columns
        return {"input": {c: get_path(row, c) for c in columns}} if columns else {}

    def crash_rows(self, rows: list[int]) -> list[OutputRow]:
        """Error rows for rows that were in flight at two engine deaths (isolated, not retried)."""
        if not rows:
            return []
        data = self.dataset.select(rows).to_list()
        return [
            crash_row(index, row_id(self.cfg, row, index), self._carried(row))
            for index, row in zip(rows, data, strict=True)
        ]

    def commit(self, shard: Shard, rows_in: list[OutputRow], record: Progress, error: Optional[str] = None) -> None:
        """Write rows as one part, then progress.json; rows_in is emptied once they are the part's."""
        t0 = time.monotonic()
        rows = sorted(rows_in, key=lambda r: r["row"])
        table = rows_to_table(rows, self.run.schema)
        # From here these rows belong to this part: emptied in the caller's list too, so an error
        # after the part is published (EIO on progress.json, on the folder's fsync) cannot make
        # the error path commit them a second time. Unpublished, they are redone on resume.
        del rows_in[:]
        self.run.shard_folder(shard.index).write_part(table)
        record.parts += 1
        record.rows_done += len(rows)
        counts = RowCounts.of(table)  # from the part's columns: a pass over Python rows per count cost more
        record.prompt_tokens += counts.prompt_tokens
        record.output_tokens += counts.output_tokens
        record.reused_rows += counts.reused_rows
        for kind, n in counts.errors.items():
            record.errors[kind] = record.errors.get(kind, 0) + n
        record.seconds.commit += time.monotonic() - t0
        record.add_point()
        self.write_progress(shard, record, error=error)
        faults.point(faults.AFTER_PROGRESS)
        if self.bar is not None:
            self.bar.committed()  # its rows/s and ETA start here
        # a dead engine ends the hold too: the next step raises, the failure is counted at once
        faults.hold(lambda: self.stop.signum is not None or self._engine_dead())

    def write_progress(self, shard: Shard, record: Progress, error: Optional[str] = None) -> None:
        """The shard's progress.json from its record (and which engine of the task writes it)."""
        write_progress(self.run.shard_folder(shard.index).progress_path, record, error, self.engine_record)

    def _count_failure(self, shard: Shard, error: BaseException) -> None:
        """Count a failed attempt of this shard (see count_failure), under the shard lock held."""
        record = self.record if self.record is not None and self.record.shard == shard.index else None
        path = self.run.shard_folder(shard.index).progress_path
        self.failures = count_failure(path, shard.index, f"{type(error).__name__}: {error}", record, self.engine_record)


@dataclass(frozen=True)
class RowCounts:
    """What progress.json counts of some output rows: tokens, reused rows, error rows by kind."""

    prompt_tokens: int
    output_tokens: int
    reused_rows: int
    errors: dict[str, int]

    @staticmethod
    def of(table: pa.Table) -> RowCounts:
        """The counts of a table of output rows (its columns the run's schema has: pooling outputs have
        no output_tokens); the same for a commit's rows and for the parts a resume reads back."""

        def total(name: str) -> int:
            return int(pc.sum(table.column(name)).as_py() or 0) if name in table.column_names else 0

        kinds = pc.value_counts(pc.drop_null(pc.struct_field(table.column("error"), "kind"))).to_pylist()
        return RowCounts(
            prompt_tokens=total("prompt_tokens"),
            output_tokens=total("output_tokens"),
            reused_rows=total(REUSED_COLUMN),
            errors={k["values"]: k["counts"] for k in kinds},
        )


def _contains(sorted_rows: Any, row: int) -> bool:
    """Whether a sorted array holds row."""
    i = int(np.searchsorted(sorted_rows, row))
    return i < len(sorted_rows) and int(sorted_rows[i]) == row
