"""The bytes of decoded images a worker holds ahead of the engine (prompt.image_window_bytes): an
image is decoded only when its pixels fit beside those held, or when none are held (one image over
the budget still runs, alone). Its bytes are held until its pixels are freed, which the worker does
once the engine has taken the image (or the row needs it no more: a duplicate, a reused answer).

Threads: the worker's ahead thread decodes (admits, hold); whichever thread drops an image's last
reference releases it (a weakref finalizer), so the lock is re-entrant."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

RGB_BYTES = 3  # bytes per pixel of a decoded image (images.open_image converts to RGB)
WAIT_S = 0.05  # a thread waiting for room checks whether it should stop this often


class NoRoom(Exception):
    """A row's decoded image does not fit beside the images held: the slice ends before that row."""

    def __init__(self, nbytes: int):
        super().__init__(f"{nbytes:,} bytes of pixels do not fit the image window")
        self.nbytes = nbytes


class ImageBudget:
    """At most `limit` bytes of decoded pixels held at once (see the module's text)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.held = 0  # bytes of the decoded images alive now
        self.peak = 0  # the most held at once
        self.images = 0  # images decoded under this budget
        self.waiting = False  # the ahead thread waits for room
        self._forced = False  # the next image is admitted whatever is held (the taker has nothing else)
        self._cond = threading.Condition(threading.RLock())

    def admits(self, nbytes: int) -> bool:
        """Whether an image of nbytes decoded pixels may be decoded now."""
        with self._cond:
            return self.held == 0 or self.held + nbytes <= self.limit or self._forced

    def hold(self, image: Any, nbytes: int) -> None:
        """Count a decoded image's bytes until it is freed."""
        with self._cond:
            self.held += nbytes
            self.images += 1
            self.peak = max(self.peak, self.held)
            self._forced = False
        weakref.finalize(image, self._release, nbytes)

    def _release(self, nbytes: int) -> None:
        with self._cond:
            self.held -= nbytes
            self._cond.notify_all()

    def wait_for_room(self, held_at_refusal: int, cancelled: Callable[[], bool]) -> None:
        """Wait until images held when one was refused room are freed (or none is held, or the taker
        forces the next one in, or cancelled())."""
        with self._cond:
            self.waiting = True
            try:
                while self.held >= held_at_refusal and self.held > 0 and not self._forced and not cancelled():
                    self._cond.wait(WAIT_S)
            finally:
                self.waiting = False

    def force(self) -> None:
        """Admit the next image whatever is held: the taker has nothing queued or in flight to free
        room with, so waiting would wait for ever."""
        with self._cond:
            self._forced = True
            self._cond.notify_all()

    def now(self) -> int:
        """Bytes held now (a moment's reading)."""
        with self._cond:
            return self.held
