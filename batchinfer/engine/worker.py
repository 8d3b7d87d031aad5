"""The shards of one task: resume from committed parts, feed the engine, commit, stop on signals."""

from __future__ import annotations

import itertools
import logging
import math
import signal
import socket
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any, Optional, Protocol

import numpy as np
import pyarrow.compute as pc

from batchinfer import faults, slurm_env
from batchinfer.config.schema import Config
from batchinfer.engine.pooled import pooling_rows
from batchinfer.engine.stream import (
    ResultCache,
    done_rows,
    first_window_rows,
    request_digest,
    result_bytes,
    todo_slices,
    window_rows,
)
from batchinfer.engine.vllm_engine import Completion
from batchinfer.errors import BatchinferError, ConfigError, StorageError
from batchinfer.inputs.openai_batch import task_mismatch
from batchinfer.inputs.read import Shard, get_path, open_input
from batchinfer.requests.build import build_request, row_id, sampling_for
from batchinfer.requests.prompts import Prompt, PromptBuilder, RowError
from batchinfer.rundir.locks import ShardLock, holder_info
from batchinfer.rundir.schema import error_row, rows_to_table
from batchinfer.rundir.stats import add_point, with_rates
from batchinfer.rundir.store import RunDir, read_json, write_json
from batchinfer.stopsignals import STOP_SIGNALS
from batchinfer.versions import installed_versions

log = logging.getLogger("batchinfer")
PREFIX_TOKENS = 32  # a system prompt or template head (longer shared runs stay in the prefix cache)
CRASHES_TO_ISOLATE = 2  # engine deaths with a row in flight before that row becomes an error row
_ATTEMPTS = itertools.count()  # this process's shard attempts: part of each request id


RequestKey = tuple[tuple[int, ...], str, int]  # prompt tokens, row's own sampling (JSON), -1 or row offset


class EngineLike(Protocol):
    """What the worker needs of an engine (engine.Engine, or a fake in unit tests)."""

    max_model_len: int
    max_num_seqs: int
    startup_seconds: float

    def sampling_params(self, sampling: dict[str, Any]) -> Any: ...
    def encode(self, prompt: Prompt, chat_template_kwargs: Optional[dict[str, Any]] = None) -> list[int]: ...
    def add(self, request_id: str, token_ids: list[int], params: Any) -> None: ...
    def step(self) -> list[Completion]: ...
    def has_unfinished(self) -> bool: ...
    def abort_all(self) -> None: ...


class Stopped(Exception):
    """A stop signal arrived; committed work is safe, the rest is left for resume."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


class StopFlag:
    """Set by signal handlers, checked between engine steps."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self.received: list[int] = []  # every stop signal, in order (logged by announce, not the handler)
        self._announced = 0

    def block(self) -> None:
        """Hold USR2 pending while the engine starts: its processes inherit the mask, so Slurm's
        group-wide USR2 cannot kill them. TERM stays deliverable so the engine can be shut down."""
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})

    def install(self) -> None:
        """Handlers that only set the flag, then deliver a USR2 that arrived meanwhile."""
        for s in STOP_SIGNALS:
            signal.signal(s, self._handle)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR2})

    def _handle(self, signum: int, frame: Any) -> None:
        # Record, and nothing else: a handler runs between any two bytecodes of the main thread, so
        # a log write here can land inside another write to the same stream and raise ("reentrant
        # call") before the signal is recorded, and the stop is lost. announce() logs it later.
        if self.signum is None:
            # The first signal's intent wins: Slurm sends TERM at the time limit after the USR2
            # that asked for a requeue, and that TERM must not turn the requeue into a plain stop.
            self.signum = signum
        self.received.append(signum)

    def announce(self) -> None:
        """Log the stop signals received since the last call (from the main flow, not the handler)."""
        upto = len(self.received)
        for i in range(self._announced, upto):
            name = signal.Signals(self.received[i]).name
            if i == 0 and self.received[0] == self.signum:
                log.warning("received %s: committing and stopping", name)
            elif self.signum is not None:
                first = signal.Signals(self.signum).name
                log.warning("received %s after %s: %s decides how this task stops", name, first, first)
        self._announced = upto


class ShardWorker:
    """Runs shards of one run directory on one (lazily started) engine."""

    def __init__(self, run: RunDir, get_engine: Callable[[], EngineLike], stop: StopFlag, bar: Any = None):
        self.run = run
        self.cfg = run.config
        self.get_engine = get_engine
        self.stop = stop
        self.bar = bar
        self._dataset: Any = None
        self.device: Optional[str] = None  # set once this worker has an engine
        self.dtype: str = self.cfg.model.dtype  # the engine's, once it has one
        self.prompts = PromptBuilder(self.cfg.prompt)
        self.pooling = pooling_rows(self.cfg, self.prompts)  # None: a generation run
        self._poison: set[RequestKey] = set()  # fault injection only
        self._crashed: dict[bytes, int] = {}  # the current shard's progress["crashed"], by digest
        self._turns_checked = False
        self._progress: Optional[dict[str, Any]] = None  # the current shard's progress record
        self.failures: Optional[int] = None  # this shard's failures in this submission, once counted
        # {"index", "of", "devices"} when the task runs several engines (cluster.engines_per_task)
        self.engine: Optional[dict[str, Any]] = None

    def _check_fixed_turns(self, engine: EngineLike) -> None:
        """Render the config's own turns through the chat template once: a template that refuses
        them (a model without a system role) would make every row an error row."""
        p = self.cfg.prompt
        if self._turns_checked or self.pooling is not None or p.mode != "chat" or not (p.system or p.examples):
            return
        try:
            engine.encode(self.prompts.fixed_turns(), p.chat_template_kwargs)
        except Exception as e:
            raise ConfigError(
                f"the model's chat template rejects the configured turns ({type(e).__name__}: {e}); "
                "unset prompt.system (or put it in prompt.template) or prompt.examples, or use prompt.mode=raw"
            ) from None
        self._turns_checked = True

    @property
    def dataset(self) -> Any:
        """The converted input, memory-mapped once."""
        if self._dataset is None:
            self._dataset = open_input(self.run.input_dir)
        return self._dataset

    def run_shard(self, shard: Shard) -> dict[str, Any]:
        """Finish one shard (resuming from its committed parts) and return its DONE record."""
        sdir = self.run.shard_dir(shard.index)
        sdir.mkdir(parents=True, exist_ok=True)
        self.failures = None
        with ShardLock(sdir, log=log.warning):
            try:
                return self._finish(shard)
            except Exception as e:
                if self.stop.signum is None and not isinstance(e, (BatchinferError, StorageError)):
                    self._count_failure(shard, e)
                raise

    def _finish(self, shard: Shard) -> dict[str, Any]:
        # Under the shard lock: what a killed writer left (temporaries, parts a finished shard's
        # compacted file replaces, a compacted file no DONE.json names) goes, finished or not.
        # DONE.json is read once: a second read (NFS negative lookup cache) could disagree with the
        # one the cleanup went by.
        sealed = self.run.done_record(shard.index)
        if self.run.clean_temporaries(shard.index, sealed):
            log.info("shard %d: removed temporaries left by a killed writer", shard.index)
        if sealed is not None:
            return sealed
        self._progress = progress = self._progress_from_parts(shard)
        committed = progress.pop("_rows")
        if len(committed):
            log.info("shard %d: resuming, %d of %d rows already committed", shard.index, len(committed), shard.rows)
        if np.count_nonzero((committed >= shard.start) & (committed < shard.stop)) < shard.rows:
            self._generate(shard, committed, progress)
        faults.point("before-done")
        done = dict(with_rates(progress), finished=time.time(), **self._reproducibility())
        # Sealed only when the committed rows are exactly the shard's range (a later copy of a row
        # dropped); missing rows raise and leave the shard for resume.
        return self.run.finish_shard(shard.index, done)

    def _reproducibility(self) -> dict[str, Any]:
        """What a reader needs to reproduce these rows: model, revision, settings, software, hardware."""
        c = self.cfg
        return {
            "model": {"path": c.model.path, "revision": c.model.revision, "dtype": self.dtype},
            "quantization": asdict(c.quantization),
            "sampling": asdict(c.sampling),
            "prompt": asdict(c.prompt),
            "host": socket.gethostname(),
            "device": self.device,
            "versions": _versions(),
            **({"engine": self.engine} if self.engine else {}),
        }

    def _progress_from_parts(self, shard: Shard) -> dict[str, Any]:
        """Counts rebuilt from committed parts (the truth), plus attempts and seconds carried over."""
        counted = [c for c in ("row", "prompt_tokens", "output_tokens", "error") if c in self.run.schema.names]
        table = self.run.read_shard(shard.index, columns=counted)  # pooling outputs have no output_tokens
        rows = done_rows(table.column("row"))  # sorted, so resume needs no set of a shard's rows
        kinds = pc.value_counts(pc.drop_null(pc.struct_field(table.column("error"), "kind"))).to_pylist()
        errors = {k["values"]: k["counts"] for k in kinds}
        old: dict[str, Any] = {}
        if self.run.progress_path(shard.index).is_file():
            old = read_json(self.run.progress_path(shard.index))
        return {
            "shard": shard.index,
            "rows_total": shard.rows,
            "rows_done": len(rows),
            "parts": len(self.run.parts(shard.index)),
            "prompt_tokens": int(pc.sum(table.column("prompt_tokens")).as_py() or 0),
            "output_tokens": int(pc.sum(table.column("output_tokens")).as_py() or 0)
            if "output_tokens" in counted
            else 0,
            "errors": errors,
            "attempts": old.get("attempts", 0) + 1,
            "failures": old.get("failures", 0),
            "failures_by_job": old.get("failures_by_job", {}),  # cluster.max_attempts counts per submission
            # rows in flight when the engine died, with how often; done rows drop out
            "suspects": {r: n for r, n in old.get("suspects", {}).items() if not _contains(rows, int(r))},
            # digest (hex) of a request the engine died on alone -> its row: duplicates are error rows
            "crashed": old.get("crashed", {}),
            "seconds": old.get("seconds", {"startup": 0.0, "prepare": 0.0, "generate": 0.0, "commit": 0.0}),
            # prompt tokens sent to the engine and those it served from its prefix cache (None: not reported)
            "prefix_cache": old.get("prefix_cache"),
            "series": old.get("series", []),  # one point per commit, for charts
            "_rows": rows,
        }

    def _request(self, index: int, row: dict[str, Any], engine: EngineLike) -> tuple[dict[str, Any], Any]:
        """A row's output base and its request key, or its error row (a bad row) in place of the key."""
        base: dict[str, Any] = {"row": index, "id": row_id(self.cfg, row, index), **self._carried(row)}
        if self.pooling is not None:
            return base, self.pooling.request(index, base, row, engine)
        why = task_mismatch(row, "generate")
        if why:
            return base, dict(error_row(index, base["id"], "unsupported", f"row {index}: {why}"), **base)
        kwargs = self.cfg.prompt.chat_template_kwargs
        try:
            req = build_request(self.cfg, self.prompts, row, index, lambda p: engine.encode(p, kwargs))
            sampling, own = req.sampling, req.own
            ids = req.fit(self.cfg.prompt.overlong, engine.max_model_len)
            engine_params(engine, self.cfg, own)
        except RowError as e:
            return base, dict(error_row(index, base["id"], e.kind, f"row {index}: {e.message}"), **base)
        dedupe = sampling["temperature"] == 0 or sampling.get("seed") is not None
        key = (tuple(ids), own, -1 if dedupe else index)
        if faults.poisoned(req.prompt):
            self._poison.add(key)
        return base, key

    def _rows(self, slices: Iterator[list[int]]) -> Iterator[tuple[int, dict[str, Any]]]:
        """(index, row) of the rows in these slices, reading one slice of the input at a time."""
        for indices in slices:
            yield from zip(indices, self.dataset.select(indices).to_list(), strict=True)

    def _generate(self, shard: Shard, committed: Any, progress: dict[str, Any]) -> None:
        """Stream the shard's remaining rows to the engine, ~2 x max_num_seqs requests in flight,
        preparing the next window between engine steps; commit between steps."""
        out = self.cfg.output
        t0 = time.monotonic()
        # A stop already pending (it came while the parts were read, or between shards) is acted on
        # before the engine starts: a 15-40 s start would spend the warning Slurm gave.
        self._check_stop()
        engine = self.get_engine()
        self._check_stop()  # a USR2 held pending while the engine started is delivered as it ends
        wake = getattr(engine, "wake_on", None)
        if wake is not None:  # vLLM's engine: a step that hangs returns when a stop is pending
            wake(lambda: self.stop.signum is not None)
        self._check_fixed_turns(engine)
        self.device = getattr(engine, "device", None)
        self.dtype = getattr(engine, "dtype", self.cfg.model.dtype)
        t_ready = time.monotonic()
        startup = t_ready - t0
        progress["seconds"]["startup"] += startup
        progress["seconds"].setdefault("prepare", 0.0)  # older records lack the key
        if self.bar is not None and startup > 1.0:
            self.bar.unpause()  # rows/s and ETA from generation, not from the engine's start-up
        if progress["prefix_cache"] is None and getattr(engine, "prefix_caching", False):
            progress["prefix_cache"] = {"queries": 0, "hits": 0}
        cache = progress["prefix_cache"]
        suspects: dict[str, int] = progress["suspects"]
        crashed = sorted(int(r) for r, n in suspects.items() if n >= CRASHES_TO_ISOLATE)
        # requests the engine died on alone: an identical one anywhere in the shard is an error row at once
        self._crashed = {bytes.fromhex(d): r for d, r in progress["crashed"].items()}
        isolated = sorted(int(r) for r, n in suspects.items() if n < CRASHES_TO_ISOLATE)
        skip = np.union1d(committed, np.asarray(crashed + isolated, dtype=np.int64))
        target = 2 * engine.max_num_seqs
        window = window_rows(engine.max_num_seqs)
        # Rows in flight at an engine death run one at a time first (their own window, fed before
        # any other), so a row that kills the engine again is known exactly; then the shard streams.
        rows = itertools.chain(
            self._rows(iter([isolated] if isolated else [])),
            self._rows(todo_slices(shard.start, shard.stop, skip, max(engine.max_num_seqs, 1))),
        )
        sizes = ([len(isolated)] if isolated else []) + [first_window_rows(engine.max_num_seqs)]

        def request(index: int, row: dict[str, Any]) -> tuple[dict[str, Any], Any]:
            return self._unless_crashed(*self._request(index, row, engine))

        feed = Feed(rows, request, self._result_row, sizes, window)
        pending = self._crash_rows(crashed)
        if self.bar is not None and pending:
            self.bar.update(len(pending))
        if isolated:
            log.warning(
                "shard %d: running %d rows in flight at the last engine death one at a time", shard.index, len(isolated)
            )
            pending += self._prepare(feed, len(isolated), progress)
        n_isolate = len(feed.queue)
        in_flight: dict[str, RequestKey] = {}
        groups = feed.groups
        last_commit = t_gen = time.monotonic()
        add_point(progress)  # generation starts: the gap since the last attempt's commit shows as 0 tok/s
        seq = finished = 0
        # Request ids unique in this process: an engine reused across shards and attempts may still
        # answer a request of an earlier attempt, which must not pass for this attempt's request.
        attempt = next(_ATTEMPTS)
        first_request = True
        # Set only inside the engine's add and step: only the engine's own failures (a refused add
        # apart) make the rows in flight suspects, not an input read error, a commit or a bug.
        in_engine = False
        try:
            while True:
                while feed.queue and len(in_flight) < (1 if n_isolate else target):
                    key = feed.queue.popleft()
                    rid = f"{shard.index}-{attempt}-{seq}"
                    seq += 1
                    ids, own, _ = key
                    try:
                        params = self._params(engine, own)
                        in_engine = True
                        engine.add(rid, list(ids), params)
                        in_engine = False
                    except (RowError, ValueError) as e:  # vLLM refused this request alone: an error row
                        in_engine = False
                        n_isolate = max(0, n_isolate - 1)  # a refused isolated request is done with too
                        kind, why = (e.kind, e.message) if isinstance(e, RowError) else ("rejected", str(e))
                        members = groups.pop(key)
                        pending.extend(
                            dict(m, **error_row(m["row"], m["id"], kind, f"row {m['row']}: vLLM refused it: {why}"))
                            for m in members
                        )
                        finished += len(members)
                        continue
                    if first_request:
                        first_request = False
                        progress["first_request_seconds"] = round(time.monotonic() - t_ready, 3)
                        log.info(
                            "shard %d: first request %.2f s after the engine was ready",
                            shard.index,
                            progress["first_request_seconds"],
                        )
                    in_flight[rid] = key
                    if key in self._poison:
                        faults.kill_engine()
                if not feed.exhausted and (len(feed.queue) < window or not in_flight):
                    t_prepare = time.monotonic()
                    done_now = self._prepare(feed, engine.max_num_seqs, progress)
                    t_gen += time.monotonic() - t_prepare  # prepare seconds are not generate seconds
                    pending += done_now
                    finished += len(done_now)
                elif not in_flight and not feed.queue:
                    break
                if in_flight:
                    in_engine = True
                    completions = engine.step()
                    in_engine = False
                    for c in completions:
                        key = in_flight.pop(c.request_id, None)
                        if key is None:  # an earlier attempt's request on this reused engine: not ours
                            log.warning("shard %d: ignoring a result for unknown request %s", shard.index, c.request_id)
                            continue
                        members = groups.pop(key)
                        n_isolate = max(0, n_isolate - 1)
                        pending.extend(self._result_row(m, c) for m in members)
                        finished += len(members)
                        feed.finished(key, c)
                        if cache is not None and c.cached_tokens is not None:
                            cache["queries"] += c.prompt_tokens
                            cache["hits"] += c.cached_tokens
                        if self.bar is not None:
                            self.bar.update(len(members))
                    faults.trace_finished(finished)
                    faults.point("in-generate")
                self._check_stop()
                now = time.monotonic()
                if len(pending) >= out.commit_every_rows or (pending and now - last_commit >= out.commit_every_seconds):
                    progress["seconds"]["generate"] += now - t_gen
                    self._commit(shard, pending, progress)
                    pending = []
                    last_commit = t_gen = time.monotonic()
        except BaseException as e:
            # Whatever stops us (signal, engine death), finished rows are committed first. A stop
            # signal may reach the engine too and kill it: that is a stop, not an error.
            try:
                suspects_now = [(m, k) for k in in_flight.values() for m in groups[k]] if in_engine else []
                self._after_error(shard, e, pending, progress, suspects_now)
            finally:
                # Only after the commit: aborting requests of a dead engine can raise. A live engine
                # is cleared so that a reused one (local runs) does not return this attempt's requests.
                if in_flight:
                    try:
                        engine.abort_all()
                    except Exception as abort_error:
                        log.warning("shard %d: aborting requests in flight failed: %r", shard.index, abort_error)
            raise
        finally:
            if wake is not None:  # a reused engine's later steps answer to their own worker's stop flag
                wake(lambda: False)
        progress["seconds"]["generate"] += time.monotonic() - t_gen
        if feed.cache.hits:
            log.info("shard %d: %d rows took an identical finished request's result", shard.index, feed.cache.hits)
        if pending:
            self._commit(shard, pending, progress)

    def _prepare(self, feed: Feed, n: int, progress: dict[str, Any]) -> list[dict[str, Any]]:
        """Prepare up to n more rows (stopping at once on a stop signal); the rows already finished.
        Its seconds count as prepare: the engine may be computing meanwhile, or waiting for it."""
        t0 = time.monotonic()
        done = feed.prepare(n, self._check_stop)  # preparing a window takes a while: act on a stop now
        progress["seconds"]["prepare"] += time.monotonic() - t0
        if self.bar is not None and done:
            self.bar.update(len(done))
        return done

    def _check_stop(self) -> None:
        """Raise Stopped if a stop signal is pending (and log what arrived)."""
        if self.stop.signum is not None:
            self.stop.announce()
            raise Stopped(self.stop.signum)

    def _after_error(
        self,
        shard: Shard,
        e: BaseException,
        pending: list[dict[str, Any]],
        progress: dict[str, Any],
        in_flight: list[tuple[dict[str, Any], RequestKey]],
    ) -> None:
        """Commit what finished; rows in flight at an engine failure (other than a stop) become
        suspects, and a request in flight at its CRASHES_TO_ISOLATE-th engine death is recorded."""
        if isinstance(e, StorageError):
            return  # committing again would fail the same way; the log says what to fix
        stopping = isinstance(e, Stopped) or self.stop.signum is not None
        if stopping:
            self.stop.announce()
        else:
            suspects, crashed = progress["suspects"], progress["crashed"]
            for m, key in in_flight:
                n = suspects[str(m["row"])] = suspects.get(str(m["row"]), 0) + 1
                if n >= CRASHES_TO_ISOLATE:
                    crashed.setdefault(request_digest(key[0], key[1]).hex(), m["row"])
        if pending:
            self._commit(shard, pending, progress, error=None if stopping else repr(e))
        elif not stopping:
            self._write_progress(shard, progress, error=repr(e))

    def _count_failure(self, shard: Shard, error: BaseException) -> None:
        """Count a failed attempt of this shard (see count_failure), under the shard lock held."""
        progress = self._progress
        if progress is None or progress.get("shard") != shard.index:  # failed before reading its parts
            progress = None
        self.failures = count_failure(self.run, shard.index, f"{type(error).__name__}: {error}", progress, self.engine)

    def _unless_crashed(self, base: dict[str, Any], made: Any) -> tuple[dict[str, Any], Any]:
        """A request identical to one the engine died on alone is an error row at once: fed again,
        it would cost CRASHES_TO_ISOLATE more engine deaths."""
        if not self._crashed or isinstance(made, dict):
            return base, made
        crashed = self._crashed.get(request_digest(made[0], made[1]))
        if crashed is None:
            return base, made
        msg = (
            f"row {base['row']}: its request is identical to row {crashed}'s, which the engine died on "
            f"{CRASHES_TO_ISOLATE} times (the second time alone); it is left out so the shard can finish"
        )
        return base, dict(error_row(base["row"], base["id"], "engine_crash", msg), **base)

    def _carried(self, row: dict[str, Any]) -> dict[str, Any]:
        """The input columns carried into the output (input.columns), if any."""
        columns = self.cfg.input.columns
        return {"input": {c: get_path(row, c) for c in columns}} if columns else {}

    def _crash_rows(self, rows: list[int]) -> list[dict[str, Any]]:
        """Error rows for rows that were in flight at two engine deaths (isolated, not retried)."""
        if not rows:
            return []
        data = self.dataset.select(rows).to_list()
        out = []
        for index, row in zip(rows, data, strict=True):
            id_ = row_id(self.cfg, row, index)
            msg = (
                f"row {index}: the engine died {CRASHES_TO_ISOLATE} times while this row was in flight "
                f"(the second time alone); it is left out so the shard can finish. Check the Slurm log "
                f"for the engine's error (out of memory, a kernel fault), or run this row alone"
            )
            out.append(dict(error_row(index, id_, "engine_crash", msg), **self._carried(row)))
        return out

    def _commit(
        self, shard: Shard, rows_in: list[dict[str, Any]], progress: dict[str, Any], error: Optional[str] = None
    ) -> None:
        """Write rows as one part, then progress.json; rows_in is emptied once they are the part's."""
        t0 = time.monotonic()
        rows = sorted(rows_in, key=lambda r: r["row"])
        table = rows_to_table(rows, self.run.schema)
        # From here these rows belong to this part: emptied in the caller's list too, so an error
        # after the part is published (EIO on progress.json, on the folder's fsync) cannot make
        # the error path commit them a second time. Unpublished, they are redone on resume.
        del rows_in[:]
        self.run.write_part(shard.index, table)
        progress["parts"] += 1
        progress["rows_done"] += len(rows)
        progress["prompt_tokens"] += sum(r["prompt_tokens"] or 0 for r in rows)
        progress["output_tokens"] += sum(r.get("output_tokens") or 0 for r in rows)
        for r in rows:
            if r["error"]:
                progress["errors"][r["error"]["kind"]] = progress["errors"].get(r["error"]["kind"], 0) + 1
        progress["seconds"]["commit"] += time.monotonic() - t0
        add_point(progress)
        self._write_progress(shard, progress, error=error)
        faults.point("after-progress")
        faults.hold(lambda: self.stop.signum is not None)

    def _write_progress(self, shard: Shard, progress: dict[str, Any], error: Optional[str] = None) -> None:
        write_progress(self.run, shard.index, progress, error, self.engine)

    def _params(self, engine: EngineLike, own: str) -> Any:
        """A request's engine params: PoolingParams for a pooling task, else its SamplingParams."""
        return self.pooling.params(engine, own) if self.pooling is not None else engine_params(engine, self.cfg, own)

    def _result_row(self, base: dict[str, Any], c: Completion) -> dict[str, Any]:
        """An output row from a finished request."""
        if self.pooling is not None:
            return self.pooling.result_row(base, c)
        row = dict(base)
        row.update(
            text=c.texts[0] if c.texts else None,
            finish_reason=c.finish_reason,
            prompt_tokens=c.prompt_tokens,
            output_tokens=c.output_tokens,
            error=None,
        )
        if len(c.texts) > 1:
            row["samples"] = c.texts
        if c.reasoning is not None:
            row["reasoning"] = c.reasoning[0] if c.reasoning else None
        labels = self.cfg.prompt.labels
        if labels.names:
            row["label"] = row["text"] if row["text"] in labels.names else None
            if labels.confidence and row["label"] is not None and c.logprob is not None:
                row["label_confidence"] = math.exp(c.logprob)
        return row


def write_progress(
    run: RunDir, index: int, progress: dict[str, Any], error: Optional[str], engine: Optional[dict[str, Any]]
) -> None:
    """progress.json of a shard: counts, rates, who writes it (and which engine of the task), last error."""
    record = dict(with_rates(progress), updated=time.time(), holder=holder_info())
    if engine:
        record["engine"] = engine
    if error:
        record["last_error"] = error
    write_json(run.progress_path(index), record)


def count_failure(
    run: RunDir,
    index: int,
    error: str,
    progress: Optional[dict[str, Any]] = None,
    engine: Optional[dict[str, Any]] = None,
) -> int:
    """Count a failed attempt of a shard in progress.json, in all and for this Slurm job
    (cluster.max_attempts is a budget per submission; a requeued task keeps its job id); the
    caller holds the shard lock. Returns the failures in this budget."""
    if progress is None:
        path = run.progress_path(index)
        progress = read_json(path) if path.is_file() else {"shard": index, "rows_done": 0}
    progress["failures"] = progress.get("failures", 0) + 1
    by_job = progress.setdefault("failures_by_job", {})
    key = budget_key()
    by_job[key] = by_job.get(key, 0) + 1
    write_progress(run, index, progress, error, engine)
    return by_job[key]


def engine_params(engine: EngineLike, cfg: Config, own: str) -> Any:
    """The engine's SamplingParams for a row; values vLLM refuses (top_p 0, max_tokens 0) raise RowError."""
    try:
        return engine.sampling_params(sampling_for(cfg, own))
    except (ValueError, TypeError) as e:
        raise RowError("sampling", f"vLLM refuses the row's sampling {own}: {e}") from None


def budget_key() -> str:
    """Whose failures count against cluster.max_attempts: this Slurm array (or job); `local` outside Slurm."""
    return slurm_env.current().submission or "local"


def failures_in_budget(progress: dict[str, Any]) -> int:
    """Failed attempts of a shard in this submission (older records: every failure counted)."""
    by_job = progress.get("failures_by_job")
    return by_job.get(budget_key(), 0) if by_job is not None else progress.get("failures", 0)


def _versions() -> dict[str, Any]:
    return dict(installed_versions(), python=sys.version.split()[0])


def work_order(key: RequestKey) -> tuple[Any, ...]:
    """Requests sharing their first PREFIX_TOKENS tokens side by side (prefix-cache hits), and
    within such a group by length, so a batch's sequences finish close together."""
    ids = key[0]
    return (ids[:PREFIX_TOKENS], len(ids), key)


class Feed:
    """A shard's requests, prepared a slice of rows at a time. A duplicate joins its identical
    request while that is not finished, or takes its result from the cache once it is; a window's
    new requests join the queue in work_order once the window is read. Window sizes: `sizes` first
    (the isolated rows, then a small first window), then `window` rows each."""

    def __init__(
        self,
        rows: Iterator[tuple[int, dict[str, Any]]],
        request: Callable[[int, dict[str, Any]], tuple[dict[str, Any], Any]],
        result_row: Callable[[dict[str, Any], Completion], dict[str, Any]],
        sizes: list[int],
        window: int,
    ):
        self.rows = rows
        self.request = request
        self.result_row = result_row
        self.sizes = deque(sizes)
        self.window = window
        self.groups: dict[RequestKey, list[dict[str, Any]]] = {}  # requests not finished, with their rows
        self.queue: deque[RequestKey] = deque()  # prepared, in work order, not yet sent
        self.cache = ResultCache()
        self.exhausted = False
        self._building: list[RequestKey] = []
        self._read = 0  # rows read into the window being built
        self._size = self.sizes.popleft() if self.sizes else window

    def prepare(self, n: int, check_stop: Callable[[], None]) -> list[dict[str, Any]]:
        """Read up to n more rows; the rows finished without the engine (error rows, cache hits)."""
        out: list[dict[str, Any]] = []
        taken = 0
        for index, row in self.rows:
            check_stop()
            base, made = self.request(index, row)
            if isinstance(made, dict):
                out.append(made)
            elif made in self.groups:
                self.groups[made].append(base)
            else:
                hit = self.cache.get(request_digest(made[0], made[1])) if made[2] == -1 else None
                if hit is not None:
                    out.append(self.result_row(base, hit))
                else:
                    self.groups[made] = [base]
                    self._building.append(made)
            self._read += 1
            if self._read >= self._size:
                self._flush()
            taken += 1
            if taken >= n:
                break
        else:
            self.exhausted = True
            self._flush()
        return out

    def finished(self, key: RequestKey, result: Completion) -> None:
        """Keep a finished request's result for identical requests still to come."""
        if key[2] == -1:
            self.cache.put(request_digest(key[0], key[1]), result, result_bytes(result))

    def _flush(self) -> None:
        """The window being built joins the queue in work order; the next window starts."""
        self.queue.extend(sorted(self._building, key=work_order))
        self._building = []
        self._read = 0
        self._size = self.sizes.popleft() if self.sizes else self.window


def _contains(sorted_rows: Any, row: int) -> bool:
    """Whether a sorted array holds row."""
    i = int(np.searchsorted(sorted_rows, row))
    return i < len(sorted_rows) and int(sorted_rows[i]) == row
