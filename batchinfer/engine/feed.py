"""A shard's requests for the engine (made ahead, ahead.py), taken a window of rows at a time and
queued in work order; identical requests share one, and a finished one's result serves identical
requests that come later."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Optional

from batchinfer.engine.ahead import LATER
from batchinfer.engine.phases import CLOCK
from batchinfer.engine.stream import ResultCache, result_bytes
from batchinfer.engine.vllm_engine import Completion
from batchinfer.requests.request import Answered, ErrorRow, RequestKey
from batchinfer.rundir.schema import OutputRow

PREFIX_TOKENS = 32  # a system prompt or template head (longer shared runs stay in the prefix cache)


def work_order(key: RequestKey) -> tuple[Any, ...]:
    """Requests sharing their first PREFIX_TOKENS tokens side by side (prefix-cache hits), and
    within such a group by length, so a batch's sequences finish close together."""
    ids = key.ids
    return (ids[:PREFIX_TOKENS], len(ids), ids, key.own, -1 if key.own_row is None else key.own_row)


def adapter_rank(adapter: Optional[str], last: Optional[str]) -> tuple[bool, bool, str]:
    """A request's place by LoRA adapter in its window: the adapter the queue ended with first (no
    swap across windows), then the others by name, the base model (None) before them."""
    return (adapter != last, adapter is not None, adapter or "")


class Feed:
    """A shard's requests, prepared a slice of rows at a time. A duplicate joins its identical
    request while that is not finished, or takes its result from the cache once it is; a window's
    new requests join the queue once the window is read, adapter by adapter (adapter_rank), each
    adapter's in work_order. Window sizes: `sizes` first (the isolated rows, then a small first
    window), then `window` rows each."""

    def __init__(
        self,
        made: Iterator[tuple[int, Any]],
        result_row: Callable[[OutputRow, Completion], OutputRow],
        sizes: list[int],
        window: int,
    ):
        self.made = iter(made)  # (index, request) of each row, in input order (ahead.Ahead)
        self.result_row = result_row
        self.sizes = deque(sizes)
        self.window = window
        self.groups: dict[RequestKey, list[OutputRow]] = {}  # requests not finished, with their rows
        self.queue: deque[RequestKey] = deque()  # prepared, in work order, not yet sent
        self.cache = ResultCache()
        self.exhausted = False
        self._building: list[RequestKey] = []
        self.last_adapter: Optional[str] = None  # the LoRA adapter of the last request queued
        self._read = 0  # rows read into the window being built
        self._size = self.sizes.popleft() if self.sizes else window

    def prepare(self, n: int, check_stop: Callable[[], None]) -> list[OutputRow]:
        """Read up to n more rows; the rows finished without the engine (error rows, cache hits)."""
        out: list[OutputRow] = []
        taken = 0
        for _, made in self.made:
            check_stop()
            if made is LATER:  # the helper waits for room: the window so far is queued, to be sent
                if self._building:
                    self._flush()
                break
            if isinstance(made, (ErrorRow, Answered)):  # a bad row, or output.reuse's answer
                out.append(made.row)
            elif made.key in self.groups:
                self.groups[made.key].append(made.base)
            else:
                hit = self.cache.get(made.key.digest()) if made.key.shared else None
                if hit is not None:
                    out.append(self.result_row(made.base, hit))
                else:
                    self.groups[made.key] = [made.base]
                    self._building.append(made.key)
            self._read += 1
            made = None  # not kept while the next is awaited: a duplicate's image leaves the window
            if self._read >= self._size:
                self._flush()
            taken += 1
            if taken >= n:
                break
        else:
            self.exhausted = True
            self._flush()
        return out

    def holding(self) -> bool:
        """Whether requests are read and not yet sent (queued, or in the window being built)."""
        return bool(self.queue or self._building)

    def finished(self, key: RequestKey, result: Completion) -> None:
        """Keep a finished request's result for identical requests still to come."""
        if key.shared:
            self.cache.put(key.digest(), result, result_bytes(result))

    def _flush(self) -> None:
        """The window being built joins the queue adapter by adapter, in work order; the next window starts."""
        with CLOCK("order"):
            last = self.queue[-1].adapter if self.queue else self.last_adapter
            if last is None and all(k.adapter is None for k in self._building):
                self.queue.extend(sorted(self._building, key=work_order))  # no LoRA adapters
            else:
                self.queue.extend(sorted(self._building, key=lambda k: (adapter_rank(k.adapter, last), work_order(k))))
                self.last_adapter = self.queue[-1].adapter if self.queue else last
        self._building = []
        self._read = 0
        self._size = self.sizes.popleft() if self.sizes else self.window
