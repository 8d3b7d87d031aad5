"""A shard's requests made ahead of the engine, a slice of rows at a time, on two helper threads: one
reads the rows, fills the template and renders the chat (Python, under the GIL), the other counts
the rendered prompts' tokens in one call of the tokenizer (which releases the GIL and spreads over
the cores), so that slice N is tokenized while slice N+1 is rendered and the main thread steps the
engine. The next window is ready before the engine drains the current one. Requests are handed over
in input order, and what making a row raised is raised where that row is taken, as if the main
thread had made it.

Images made ahead are held within a budget (Room): a slice ends before a row whose image has no
room, and the helper waits for the taker to send images to the engine before it makes the rest;
meanwhile a taker with requests queued or in flight is told "later" rather than kept waiting."""

from __future__ import annotations

import gc
import os
import queue
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional, Union

from batchinfer.requests.image_budget import ImageBudget
from batchinfer.requests.request import Made

Item = Union[Made, BaseException]  # a row's request, or what making it raised
WAIT_S = 0.05  # a taker waiting for the helper checks for a stop signal this often
SWITCH_S = 0.001  # the interpreter's thread switch interval while a shard streams (Python's default: 5 ms)
_END = object()  # the slices are all made
LATER = object()  # what a taker gets instead of a request while the helper waits for image room


@dataclass(frozen=True)
class Room:
    """The image budget a slice's making holds its decoded images under; `rest(state)`: the rows of
    a begun slice it left for later (no room for their images); `defer()`: whether the taker has
    requests queued or in flight (sending them frees room), so it may take LATER instead of waiting."""

    budget: ImageBudget
    rest: Callable[[Any], list[int]]
    defer: Callable[[], bool]


GC_YOUNG = 20_000  # allocations between two young collections while a shard streams (Python's: 700)
_streaming = 0  # shards streaming in this process (the collector is set for streaming while > 0)
_threshold: tuple[int, int, int] = (700, 10, 10)  # the collector's thresholds before the first
_streaming_lock = threading.Lock()


def _collector_for_streaming() -> None:
    """While a shard streams, the cyclic garbage collector sets aside what the process held before
    (modules, tokenizer, engine: gc.freeze) and collects young objects every GC_YOUNG allocations:
    its collections cost ~40 µs a row of a 210-token prompt (a tenth of the worker's CPU) walking
    all of it again and again (issue 44). Only when garbage cycles are collected changes."""
    global _streaming, _threshold
    with _streaming_lock:
        if _streaming == 0:
            _threshold = gc.get_threshold()
            gc.freeze()
            gc.set_threshold(max(_threshold[0], GC_YOUNG), *_threshold[1:])
        _streaming += 1


def _collector_restored() -> None:
    """The last shard streaming in the process ended: the collector as before, the frozen objects
    collectable again (a closed vLLM engine's segments are unlinked when its objects are collected)."""
    global _streaming
    with _streaming_lock:
        _streaming -= 1
        if _streaming == 0:
            gc.unfreeze()
            gc.set_threshold(*_threshold)


class _Failed:
    """Making a slice failed outside any one row's making (reading it): raised where it is taken."""

    def __init__(self, error: BaseException):
        self.error = error


class Ahead:
    """Slices of row indices made into requests at most `depth` slices ahead of the taker; iterate
    once for (index, request) in input order. A slice is `begin(indices)` (a state), then
    `tokenize(state)` on the tokenizer thread, then `finish(state)` -> [(index, item)]. A pending
    stop ends the making (the taker raises Stopped, see _take): the time a stop gives is not spent."""

    def __init__(
        self,
        slices: Iterator[list[int]],
        begin: Callable[[list[int]], Any],
        tokenize: Callable[[Any], None],
        finish: Callable[[Any], list[tuple[int, Item]]],
        depth: int,
        check_stop: Callable[[], None],
        stopping: Callable[[], bool],
        room: Optional[Room] = None,
    ):
        self.slices = slices
        self.room = room
        self.begin, self.tokenize, self.finish = begin, tokenize, finish
        self.check_stop = check_stop  # raises Stopped: a taker waiting on the helper still stops
        self.stopping = stopping  # a stop is pending: the helper makes no further slice
        self._made: queue.Queue[Any] = queue.Queue(maxsize=max(depth, 1))
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="batchinfer-ahead", daemon=True)
        # One core: nothing to overlap, the helper tokenizes each slice itself.
        self._tokenizer = ThreadPoolExecutor(1, "batchinfer-tokenize") if len(os.sched_getaffinity(0)) > 1 else None
        self._started = False
        self._switch: Optional[float] = None  # the interpreter's switch interval while streaming
        self._froze = False  # this stream set the collector for streaming (_collector_for_streaming)

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        if not self._started:
            self._started = True
            # The main thread takes the GIL back from the helpers within 1 ms (not 5) of an engine
            # step's return: a synchronous engine would wait that long for its next requests.
            self._switch = sys.getswitchinterval()
            sys.setswitchinterval(min(self._switch, SWITCH_S))
            _collector_for_streaming()
            self._froze = True
            self._thread.start()
        while True:
            batch = self._take()
            if batch is _END:
                return
            if batch is LATER:
                yield -1, LATER
                continue
            if isinstance(batch, _Failed):
                raise batch.error
            batch.reverse()
            while batch:  # popped, not iterated: a taken request's image is not kept alive here
                index, made = batch.pop()
                if isinstance(made, BaseException):
                    raise made
                yield index, made
                made = None

    def _take(self) -> Any:
        """The next made slice, waiting for the helper (a stop signal meanwhile raises Stopped)."""
        while True:
            budget = self.room.budget if self.room is not None else None
            if budget is not None and budget.waiting and self._made.empty():
                if self.room.defer():  # type: ignore[union-attr]
                    return LATER  # send what is queued: that frees the room the helper waits for
                budget.force()  # nothing the taker holds frees room: over the budget rather than wait for ever
            try:
                return self._made.get(timeout=WAIT_S)
            except queue.Empty:
                self.check_stop()
                if not self._thread.is_alive() and self._made.empty():
                    raise RuntimeError("the thread making requests ahead ended without a word") from None

    def _run(self) -> None:
        pending: Optional[tuple[Any, Future[None]]] = None  # the slice being tokenized
        try:
            slices = iter(self.slices)
            rest: list[int] = []
            while True:
                indices = rest or next(slices, None)
                if indices is None:
                    break
                if self._closed.is_set() or self.stopping():
                    return
                held = self.room.budget.now() if self.room is not None else 0
                try:
                    state = self.begin(indices)  # rendered while the slice before is tokenized
                except BaseException as e:
                    if self._hand_over(pending):
                        self._put(_Failed(e))  # after the slices before it
                    return
                rest = self.room.rest(state) if self.room is not None else []
                if rest and len(rest) == len(indices):  # not one row had room: wait for the taker to send
                    if not self._hand_over(pending):
                        return
                    pending = None
                    self._wait_for_room(held)
                    continue
                job = self._tokenize(state)
                if not self._hand_over(pending):
                    return
                pending = (state, job)
            if self._hand_over(pending):
                self._put(_END)
        except BaseException as e:  # tokenizing or finishing a slice: raised where it starts
            self._put(_Failed(e))

    def _wait_for_room(self, held: int) -> None:
        """Wait until images held when a slice found no room are sent (or the making stops)."""
        assert self.room is not None
        self.room.budget.wait_for_room(held, lambda: self._closed.is_set() or self.stopping())

    def _tokenize(self, state: Any) -> Future[None]:
        """Count a slice's tokens on the tokenizer thread (here, with one core)."""
        if self._tokenizer is not None:
            return self._tokenizer.submit(self.tokenize, state)
        done: Future[None] = Future()
        self.tokenize(state)
        done.set_result(None)
        return done

    def _hand_over(self, pending: Optional[tuple[Any, Future[None]]]) -> bool:
        """Finish a tokenized slice and hand it over; False once closed."""
        if pending is None:
            return True
        state, job = pending
        job.result()
        return self._put(self.finish(state))

    def _put(self, item: Any) -> bool:
        """Hand a made slice over, waiting while `depth` are untaken; False once closed."""
        while not self._closed.is_set():
            try:
                self._made.put(item, timeout=WAIT_S)
                return True
            except queue.Full:
                continue
        return False

    def close(self) -> None:
        """Stop the helpers (after the slice each is on) and wait for them."""
        self._closed.set()
        if self._started:
            self._thread.join()
        if self._tokenizer is not None:
            self._tokenizer.shutdown(wait=True)
        if self._switch is not None:
            sys.setswitchinterval(self._switch)
            self._switch = None
        if self._froze:
            self._froze = False
            _collector_restored()
