"""A shard's requests made ahead of the engine on a helper thread, a slice of rows at a time: reading
the rows, filling the template, rendering the chat and tokenizing (the tokenizer's batch call releases
the GIL) go on while the main thread steps the engine, so the next window is ready before the engine
drains the current one. Requests are handed over in input order, and what making a row raised is
raised where that row is taken, as if the main thread had made it."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any, Union

from batchinfer.requests.request import Made

Item = Union[Made, BaseException]  # a row's request, or what making it raised
WAIT_S = 0.05  # a taker waiting for the helper checks for a stop signal this often
_END = object()  # the slices are all made


class _Failed:
    """The helper failed outside any one row's making (reading a slice): raised where it is taken."""

    def __init__(self, error: BaseException):
        self.error = error


class Ahead:
    """Slices of row indices made into requests by `make` on a helper thread, at most `depth`
    slices ahead of the taker; iterate once for (index, request) in input order. A pending stop
    ends the making (the taker raises Stopped, see _take); the time a stop gives is not spent."""

    def __init__(
        self,
        slices: Iterator[list[int]],
        make: Callable[[list[int]], list[tuple[int, Item]]],
        depth: int,
        check_stop: Callable[[], None],
        stopping: Callable[[], bool],
        name: str = "batchinfer-ahead",
    ):
        self.slices = slices
        self.make = make
        self.check_stop = check_stop  # raises Stopped: a taker waiting on the helper still stops
        self.stopping = stopping  # a stop is pending: the helper makes no further slice
        self._made: queue.Queue[Any] = queue.Queue(maxsize=max(depth, 1))
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._started = False

    def __iter__(self) -> Iterator[tuple[int, Made]]:
        if not self._started:
            self._started = True
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
        try:
            for indices in self.slices:
                if self._closed.is_set() or self.stopping():
                    return
                if not self._put(self.make(indices)):
                    return
        except BaseException as e:  # the taker raises it where the failed slice would start
            self._put(_Failed(e))
            return
        self._put(_END)

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
        """Stop the helper (after the slice it is making) and wait for it."""
        self._closed.set()
        if self._started:
            self._thread.join()
