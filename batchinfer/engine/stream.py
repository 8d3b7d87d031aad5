"""A shard streamed to the engine: the rows still to do, read a slice at a time, and the results of
finished requests kept (within a memory budget) for duplicates that come in later windows."""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, Optional

import numpy as np

# A window is the rows prepared, grouped and put in work order together: WINDOW_SEQS x max_num_seqs
# rows (4 engine queues' worth at ~2 x max_num_seqs in flight), at least WINDOW_MIN_ROWS. The first
# window is one queue's worth (2 x max_num_seqs), so the first request waits only for that.
WINDOW_SEQS = 8
WINDOW_MIN_ROWS = 1024
# Finished results kept for identical requests in later windows: an entry counts ENTRY_BYTES plus
# the bytes its texts, reasoning texts and vector hold (short outputs: ~32K entries; 4K-character
# ASCII outputs: ~6K; a Chinese or emoji text holds 2 or 4 bytes a character).
RESULT_CACHE_BYTES = 32 << 20
ENTRY_BYTES = 1024


def window_rows(max_num_seqs: int) -> int:
    """Rows per window after the first."""
    return max(WINDOW_SEQS * max_num_seqs, WINDOW_MIN_ROWS)


def first_window_rows(max_num_seqs: int) -> int:
    """Rows of the first window: what the engine takes in flight at once."""
    return max(2 * max_num_seqs, 1)


def slice_rows(max_num_seqs: int) -> int:
    """Rows read, rendered and tokenized together (a slice of todo_slices)."""
    return max(max_num_seqs, 1)


def ahead_slices(max_num_seqs: int) -> int:
    """Slices the helper thread (ahead.py) keeps made and not yet taken, at most: the next window
    and a first window's worth, so the engine never waits for a window to be made."""
    rows = window_rows(max_num_seqs) + first_window_rows(max_num_seqs)
    return -(-rows // slice_rows(max_num_seqs)) + 1


def done_rows(rows: Any) -> np.ndarray:
    """Committed row indices (an Arrow column) as a sorted int64 array without repeats."""
    return np.unique(np.asarray(rows, dtype=np.int64))


def todo_slices(start: int, stop: int, skip: np.ndarray, size: int) -> Iterator[list[int]]:
    """Row indices of [start, stop) that are not in skip (sorted), in input order, about size at a
    time: computed a slice at a time, so a 1M-row shard never holds a 1M-entry list, and gathered
    across mostly committed ranges, so a resumed shard is not read a few rows per call."""
    gathered: list[int] = []
    for a in range(start, stop, size):
        b = min(a + size, stop)
        lo, hi = np.searchsorted(skip, [a, b])
        keep = np.ones(b - a, dtype=bool)
        keep[skip[lo:hi] - a] = False
        gathered += (np.flatnonzero(keep) + a).tolist()
        if len(gathered) >= size:
            yield gathered
            gathered = []
    if gathered:
        yield gathered


def result_bytes(result: Any) -> int:
    """Memory a finished result (a Completion) holds: its texts and reasoning texts as Python keeps
    them (1, 2 or 4 bytes a character, whichever the widest needs) and its pooled vector."""
    texts = [*result.texts, *(result.reasoning or [])]
    held = sum(sys.getsizeof(t) for t in texts if t is not None)
    return held + (result.pooled.nbytes if result.pooled is not None else 0)


class ResultCache:
    """Least recently used finished results, by request digest, within a byte budget."""

    def __init__(self, budget: Optional[int] = None):
        self.budget = RESULT_CACHE_BYTES if budget is None else budget
        self.size = 0
        self.hits = 0
        self._items: OrderedDict[bytes, tuple[Any, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, digest: bytes) -> Optional[Any]:
        """The result of an identical finished request, if still kept."""
        item = self._items.get(digest)
        if item is None:
            return None
        self._items.move_to_end(digest)
        self.hits += 1
        return item[0]

    def put(self, digest: bytes, result: Any, nbytes: int) -> None:
        """Keep a finished result (holding nbytes), dropping the least recently used past the budget."""
        cost = ENTRY_BYTES + nbytes
        if cost > self.budget:
            return
        old = self._items.pop(digest, None)
        if old is not None:
            self.size -= old[1]
        self._items[digest] = (result, cost)
        self.size += cost
        while self.size > self.budget:
            _, (_, dropped) = self._items.popitem(last=False)
            self.size -= dropped
