"""One attempt at a shard's remaining rows on a started engine, in small steps as vLLM splits
add/step/collect: submit ready requests (about 2 x max_num_seqs in flight), refill the feed, drain
one engine step, maybe commit. The same for generation and pooling: only the task's rows differ."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from typing import Any, Optional, Protocol

import numpy as np

from batchinfer import faults
from batchinfer.config.schema import Config
from batchinfer.engine.ahead import Ahead, Item, Room
from batchinfer.engine.commit_policy import CommitPolicy
from batchinfer.engine.crashes import Crashes, count_suspects
from batchinfer.engine.drafted import Drafted, Keyed, RowIn, SliceDraft
from batchinfer.engine.feed import Feed
from batchinfer.engine.image_ahead import ImageAhead
from batchinfer.engine.lora_slots import LoraSlots, engine_loads
from batchinfer.engine.phases import CLOCK
from batchinfer.engine.rowbar import RowBar
from batchinfer.engine.stopflag import StopFlag
from batchinfer.engine.stream import ahead_slices, first_window_rows, slice_rows, todo_slices, window_rows
from batchinfer.engine.vllm_engine import Completion
from batchinfer.errors import Stopped, StorageError
from batchinfer.inputs.shards import Shard
from batchinfer.requests.image_budget import ImageBudget
from batchinfer.requests.prompts import Prompt
from batchinfer.requests.request import ErrorRow, Made, RequestKey
from batchinfer.requests.verdict import engine_refusal
from batchinfer.rundir.progress import Progress
from batchinfer.rundir.schema import OutputRow, error_row

log = logging.getLogger("batchinfer")
_ATTEMPTS = itertools.count()  # this process's shard attempts: part of each request id


class EngineLike(Protocol):
    """What the worker needs of an engine (vllm_engine.Engine, or a fake in unit tests)."""

    max_model_len: int
    max_num_seqs: int
    startup_seconds: float

    def sampling_params(self, sampling: dict[str, Any]) -> Any: ...
    def encode(self, prompt: Prompt, chat_template_kwargs: Optional[dict[str, Any]] = None) -> list[int]: ...
    def add(self, request_id: str, token_ids: list[int], params: Any) -> None: ...  # adapter=NAME with LoRA
    def step(self) -> list[Completion]: ...
    def has_unfinished(self) -> bool: ...
    def abort_all(self) -> None: ...


class TaskRows(Protocol):
    """A task's rows <-> engine requests (generation.GenerationRows, pooled.PoolingRows)."""

    poisoned: set[RequestKey]  # fault injection: requests that kill the engine when added

    def request(self, index: int, base: OutputRow, row: dict[str, Any], engine: Any) -> RequestKey | ErrorRow: ...
    def requests(self, rows: list[RowIn], engine: Any) -> list[Keyed]: ...
    def draft(self, rows: list[RowIn], engine: Any, images: Optional[ImageBudget] = None) -> Drafted: ...
    def finish(self, d: Drafted, engine: Any) -> list[Keyed]: ...
    def params(self, engine: Any, own: str) -> Any: ...
    def result_row(self, base: OutputRow, c: Completion) -> OutputRow: ...


class ShardRunner(Protocol):
    """What the scheduler needs of the worker whose shard it streams (worker.ShardWorker is one)."""

    cfg: Config
    task_rows: TaskRows
    stop: StopFlag
    bar: Optional[RowBar]
    node_fault: Callable[[], Optional[str]]  # why the engine failed when another node caused it

    @property
    def dataset(self) -> Any: ...
    def draft(
        self, rows: list[tuple[int, dict[str, Any]]], engine: EngineLike, images: Optional[ImageBudget] = None
    ) -> SliceDraft: ...
    def finish(self, draft: SliceDraft, engine: EngineLike) -> list[Made | Exception]: ...
    def crash_rows(self, rows: list[int]) -> list[OutputRow]: ...
    def commit(self, shard: Shard, rows_in: list[OutputRow], record: Progress, error: Optional[str] = None) -> None: ...
    def write_progress(self, shard: Shard, record: Progress, error: Optional[str] = None) -> None: ...


class ShardScheduler:
    """Streams a shard's rows not yet committed to the engine and commits between engine steps."""

    def __init__(
        self, worker: ShardRunner, shard: Shard, record: Progress, engine: EngineLike, committed: Any, t_ready: float
    ):
        """committed: the shard's committed rows (sorted); t_ready: when the engine was ready."""
        self.worker, self.shard, self.record, self.engine = worker, shard, record, engine
        self.crashes = Crashes(record)
        isolated = self.crashes.isolated
        skip = np.union1d(committed, np.asarray(self.crashes.crashed_rows + isolated, dtype=np.int64))
        self.target = 2 * engine.max_num_seqs
        self.window = window_rows(engine.max_num_seqs)
        # Rows in flight at an engine death run one at a time first (their own window, fed before
        # any other), so a row that kills the engine again is known exactly; then the shard streams.
        # A helper thread makes the requests (read, render, tokenize) about a window ahead.
        size = slice_rows(engine.max_num_seqs)
        slices = itertools.chain([isolated] if isolated else [], todo_slices(shard.start, shard.stop, skip, size))
        depth = ahead_slices(engine.max_num_seqs)
        # Decoded images made ahead are held within cluster.image_window_mb (freed once sent).
        self.images = ImageBudget(worker.cfg.cluster.image_window_mb << 20)
        self.ahead = Ahead(
            slices,
            self._begin,
            lambda begun: begun[1].tokenize(),
            self._finish,
            depth,
            worker.stop.check,
            lambda: worker.stop.signum is not None,
            Room(self.images, lambda begun: begun[2], lambda: bool(self.in_flight) or self.feed.holding()),
        )
        # vLLM's image processor runs for the next requests to send on a thread of its own, not in add
        # (made at the first request with an image, where the engine can: image_ahead.py).
        self.image_ahead: Optional[ImageAhead] = None
        sizes = ([len(isolated)] if isolated else []) + [first_window_rows(engine.max_num_seqs)]
        self.feed = Feed(self.ahead, worker.task_rows.result_row, sizes, self.window)
        self.pending: list[OutputRow] = worker.crash_rows(self.crashes.crashed_rows)  # rows to commit
        self.in_flight: dict[str, RequestKey] = {}  # request id -> key, sent and not finished
        self.slots = LoraSlots(getattr(engine, "max_loras", None))  # LoRA adapters in flight
        # the engine's adapter loads so far (it may have run other shards) and the shard's earlier attempts'
        self.loads_at_start = engine_loads(engine)
        if self.loads_at_start is not None and record.adapter_loads is None:
            record.adapter_loads = 0
        self.loads_before = record.adapter_loads or 0
        self.n_isolate = 0  # isolated requests still to finish: while any, one request at a time
        self.finished = 0  # rows finished in this attempt (for the trace)
        self.seq = 0
        # Request ids unique in this process: an engine reused across shards and attempts may still
        # answer a request of an earlier attempt, which must not pass for this attempt's request.
        self.attempt = next(_ATTEMPTS)
        # Set only inside the engine's add and step: only the engine's own failures (a refused add
        # apart) make the rows in flight suspects, not an input read error, a commit or a bug.
        self.in_engine = False
        self.t_ready = t_ready
        self.t_gen = self.last_commit = time.monotonic()
        self.policy = CommitPolicy.for_shard(worker.cfg.output, shard.rows)
        self.first_request = True

    def _begin(self, indices: list[int]) -> tuple[list[int], SliceDraft, list[int]]:
        """A slice's rows read and drafted (on the helper thread; their tokens are counted next):
        (rows drafted, their draft, rows left for later: their images had no room yet)."""
        with CLOCK("read"):
            rows = self.worker.dataset.select(indices).to_list()
        draft = self.worker.draft(list(zip(indices, rows, strict=True)), self.engine, self.images)
        taken = len(draft.out)
        return indices[:taken], draft, indices[taken:]

    def _finish(self, begun: tuple[list[int], SliceDraft, list[int]]) -> list[tuple[int, Item]]:
        """A drafted slice's requests, once its tokens are counted; crashed ones are error rows."""
        indices, draft, _ = begun
        made = self.worker.finish(draft, self.engine)
        return [
            (i, m if isinstance(m, BaseException) else self.crashes.unless_crashed(m))
            for i, m in zip(indices, made, strict=True)
        ]

    def run(self) -> None:
        """Every remaining row answered and committed; on any exception, finished rows are committed
        first, then it is raised."""
        if self.worker.bar is not None and self.pending:
            self.worker.bar.update(len(self.pending))
        isolated = self.crashes.isolated
        if isolated:
            log.warning(
                "shard %d: running %d rows in flight at the last engine death one at a time",
                self.shard.index,
                len(isolated),
            )
            self.pending += self._prepare(len(isolated))
        self.n_isolate = len(self.feed.queue)
        self.last_commit = self.t_gen = time.monotonic()
        self.record.add_point()  # generation starts: the gap since the last attempt's commit shows as 0 tok/s
        try:
            while self.step():
                pass
        except BaseException as e:
            self._close_helpers()  # before the commit: the helpers stop making requests no one takes
            self._after_error(e)
            raise
        finally:
            self._close_helpers()
        self.record.seconds.generate += time.monotonic() - self.t_gen
        if self.feed.cache.hits:
            log.info(
                "shard %d: %d rows took an identical finished request's result", self.shard.index, self.feed.cache.hits
            )
        if self.pending:
            # counted at commits the engine is healthy at, not after an error: it may be dead or hung
            self._count_loads()
            self.worker.commit(self.shard, self.pending, self.record)

    def _count_loads(self) -> None:
        """The shard's adapter loads in its record, as the engine counts them (LoRA engines only)."""
        now = engine_loads(self.engine) if self.loads_at_start is not None else None
        if now is not None:
            self.record.adapter_loads = self.loads_before + now - self.loads_at_start

    def _close_helpers(self) -> None:
        """Stop the threads that make requests and process images ahead."""
        self.ahead.close()
        if self.image_ahead is not None:
            self.image_ahead.close()

    def step(self) -> bool:
        """One round: submit, refill, drain one engine step, maybe commit; False once all is answered."""
        self.submit()
        if not self.refill() and not self.in_flight and not self.feed.queue:
            return False
        if self.image_ahead is None and self.feed.queue and self.feed.queue[0].image is not None:
            self.image_ahead = ImageAhead.of(self.engine, self.engine.max_num_seqs, self.images)
        if self.image_ahead is not None:  # the next requests' images, processed while the engine steps
            self.image_ahead.ahead(itertools.islice(self.feed.queue, self.image_ahead.depth))
        if self.in_flight:
            self.drain()
        self.worker.stop.check()
        self.maybe_commit()
        return True

    def submit(self) -> None:
        """Send queued requests while fewer than the target are in flight (one while isolating)."""
        with CLOCK("submit"):
            self._submit()

    def _submit(self) -> None:
        while self.feed.queue and len(self.in_flight) < (1 if self.n_isolate else self.target):
            if not self.slots.admits(self.feed.queue[0].adapter):
                break  # one more adapter than the engine's slots: after those in flight finish
            key = self.feed.queue.popleft()
            rid = f"{self.shard.index}-{self.attempt}-{self.seq}"
            self.seq += 1
            try:
                params = self.worker.task_rows.params(self.engine, key.own)
                self.in_engine = True
                extra: dict[str, Any] = {}  # only what the request has: stand-ins take no more
                if key.adapter is not None:  # a LoRA adapter's request (model.lora.adapters)
                    extra["adapter"] = key.adapter
                if key.image is not None:  # a row's image (prompt.image_column)
                    extra["image"] = self._image(key)
                self.engine.add(rid, list(key.ids), params, **extra)
                self.in_engine = False
                key.pixels = None  # the engine has the image now: its bytes leave the image window
                extra.clear()
            except Exception as e:  # vLLM refused this request alone (whatever its type): an error row
                if getattr(self.engine, "dead", False):
                    raise  # the engine died: not this request's fault (in_engine: rows in flight are suspects)
                self.in_engine = False
                self._refused(key, e)
                continue
            if self.first_request:
                self.first_request = False
                self.record.first_request_seconds = round(time.monotonic() - self.t_ready, 3)
                log.info(
                    "shard %d: first request %.2f s after the engine was ready",
                    self.shard.index,
                    self.record.first_request_seconds,
                )
            self.in_flight[rid] = key
            self.slots.sent(key.adapter)
            if key in self.worker.task_rows.poisoned:
                faults.kill_engine()

    def _image(self, key: RequestKey) -> Any:
        """A request's image for the engine's add: processed ahead where the engine can, else
        (content digest, decoded image)."""
        if self.image_ahead is None:
            self.image_ahead = ImageAhead.of(self.engine, self.engine.max_num_seqs, self.images)
            if self.image_ahead is None:
                return key.image, key.pixels
        return self.image_ahead.take(key)

    def _refused(self, key: RequestKey, e: Exception) -> None:
        """The rows of a request the engine refused are error rows."""
        self.n_isolate = max(0, self.n_isolate - 1)  # a refused isolated request is done with too
        refused = engine_refusal(e, "engine_refused", "vLLM refused it")
        members = self.feed.groups.pop(key)
        self.pending.extend(
            dict(m, **error_row(m["row"], m["id"], refused.kind, f"row {m['row']}: {refused.message}")) for m in members
        )
        self.finished += len(members)

    def refill(self) -> bool:
        """Prepare more rows while the queue runs short (or nothing is in flight); whether it did."""
        if self.feed.exhausted or (len(self.feed.queue) >= self.window and self.in_flight):
            return False
        t_prepare = time.monotonic()
        done_now = self._prepare(self.engine.max_num_seqs)
        self.t_gen += time.monotonic() - t_prepare  # prepare seconds are not generate seconds
        self.pending += done_now
        self.finished += len(done_now)
        return True

    def _prepare(self, n: int) -> list[OutputRow]:
        """Prepare up to n more rows (stopping at once on a stop signal); the rows already finished.
        Its seconds count as prepare: the engine may be computing meanwhile, or waiting for it."""
        t0 = time.monotonic()
        with CLOCK("dedup"):  # taking made requests: waiting for the helper costs no CPU here
            done = self.feed.prepare(n, self.worker.stop.check)  # act on a stop at once, row by row
        self.record.seconds.prepare += time.monotonic() - t0
        if self.worker.bar is not None and done:
            self.worker.bar.update(len(done))
        return done

    def drain(self) -> None:
        """Run one engine step and take the requests it finished."""
        self.in_engine = True
        completions = self.engine.step()
        self.in_engine = False
        with CLOCK("collect"):
            for c in completions:
                self._collect(c)
        faults.trace_finished(self.finished)
        faults.point(faults.IN_GENERATE)

    def _collect(self, c: Completion) -> None:
        """A finished request's rows join the rows to commit."""
        key = self.in_flight.pop(c.request_id, None)
        if key is None:  # an earlier attempt's request on this reused engine: not ours
            log.warning("shard %d: ignoring a result for unknown request %s", self.shard.index, c.request_id)
            return
        self.slots.done(key.adapter)
        members = self.feed.groups.pop(key)
        self.n_isolate = max(0, self.n_isolate - 1)
        self.pending.extend(self.worker.task_rows.result_row(m, c) for m in members)
        self.finished += len(members)
        self.feed.finished(key, c)
        cache = self.record.prefix_cache
        if cache is not None and c.cached_tokens is not None:
            cache.queries += c.prompt_tokens
            cache.hits += c.cached_tokens
        if self.worker.bar is not None:
            self.worker.bar.update(len(members))

    def maybe_commit(self) -> None:
        """Commit the finished rows when the commit policy says so (commit_policy.py)."""
        now = time.monotonic()
        if self.policy.due(len(self.pending), now - self.last_commit):
            self.record.seconds.generate += now - self.t_gen
            self._count_loads()
            self.worker.commit(self.shard, self.pending, self.record)
            self.pending = []
            self.last_commit = self.t_gen = time.monotonic()

    def _after_error(self, e: BaseException) -> None:
        """Whatever stops the attempt (a signal, an engine death), finished rows are committed first;
        rows in flight at an engine failure (not a stop) become suspects (see crashes.py). A stop
        signal may reach the engine too and kill it: that is a stop, not an error."""
        try:
            in_flight = self._in_flight_rows() if self.in_engine else []
            if isinstance(e, StorageError):
                return  # committing again would fail the same way; the log says what to fix
            stopping = isinstance(e, Stopped) or self.worker.stop.signum is not None
            node = None if stopping else self.worker.node_fault()
            if stopping:
                self.worker.stop.announce()
            elif node is not None:  # another node's death: the rows in flight did nothing wrong
                log.warning(
                    "shard %d: %s: a node's fault; the %d rows in flight are not suspects",
                    self.shard.index,
                    node,
                    len(in_flight),
                )
            else:
                count_suspects(self.record, in_flight)
            if self.pending:
                self.worker.commit(self.shard, self.pending, self.record, error=None if stopping else repr(e))
            elif not stopping:
                self.worker.write_progress(self.shard, self.record, error=repr(e))
        finally:
            # Only after the commit: aborting requests of a dead engine can raise. A live engine
            # is cleared so that a reused one (local runs) does not return this attempt's requests.
            if self.in_flight:
                try:
                    self.engine.abort_all()
                except Exception as abort_error:
                    log.warning("shard %d: aborting requests in flight failed: %r", self.shard.index, abort_error)

    def _in_flight_rows(self) -> list[tuple[OutputRow, RequestKey]]:
        """(output base, request) of every row in flight."""
        return [(m, k) for k in self.in_flight.values() for m in self.feed.groups[k]]
