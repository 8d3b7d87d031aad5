"""A shard's requests made ahead of the engine, a slice of rows at a time, on two helper threads: one
reads the rows, fills the template and renders the chat (Python, under the GIL), the other counts
the rendered prompts' tokens in one call of the tokenizer (which releases the GIL and spreads over
the cores), so that slice N is tokenized while slice N+1 is rendered and the main thread steps the
engine. The next window is ready before the engine drains the current one. Requests are handed over
in input order, and what making a row raised is raised where that row is taken, as if the main
thread had made it."""

from __future__ import annotations

import os
import queue
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional, Union

from batchinfer.requests.request import Made

Item = Union[Made, BaseException]  # a row's request, or what making it raised
WAIT_S = 0.05  # a taker waiting for the helper checks for a stop signal this often
SWITCH_S = 0.001  # the interpreter's thread switch interval while a shard streams (Python's default: 5 ms)
_END = object()  # the slices are all made


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
    ):
        self.slices = slices
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

    def __iter__(self) -> Iterator[tuple[int, Made]]:
        if not self._started:
            self._started = True
            # The main thread takes the GIL back from the helpers within 1 ms (not 5) of an engine
            # step's return: a synchronous engine would wait that long for its next requests.
            self._switch = sys.getswitchinterval()
            sys.setswitchinterval(min(self._switch, SWITCH_S))
            self._thread.start()
        while True:
            batch = self._take()
            if batch is _END:
                return
            if isinstance(batch, _Failed):
                raise batch.error
            for index, made in batch:
                if isinstance(made, BaseException):
                    raise made
                yield index, made

    def _take(self) -> Any:
        """The next made slice, waiting for the helper (a stop signal meanwhile raises Stopped)."""
        while True:
            try:
                return self._made.get(timeout=WAIT_S)
            except queue.Empty:
                self.check_stop()
                if not self._thread.is_alive() and self._made.empty():
                    raise RuntimeError("the thread making requests ahead ended without a word") from None

    def _run(self) -> None:
        pending: Optional[tuple[Any, Future[None]]] = None  # the slice being tokenized
        try:
            for indices in self.slices:
                if self._closed.is_set() or self.stopping():
                    return
                try:
                    state = self.begin(indices)  # rendered while the slice before is tokenized
                except BaseException as e:
                    if self._hand_over(pending):
                        self._put(_Failed(e))  # after the slices before it
                    return
                job = self._tokenize(state)
                if not self._hand_over(pending):
                    return
                pending = (state, job)
            if self._hand_over(pending):
                self._put(_END)
        except BaseException as e:  # tokenizing or finishing a slice: raised where it starts
            self._put(_Failed(e))

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
