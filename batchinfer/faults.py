"""Named fault points: BATCHINFER_FAULT=name[:n] SIGKILLs the process at the nth hit (tests)."""

from __future__ import annotations

import os
import signal
from collections import Counter

ENV = "BATCHINFER_FAULT"
POINTS = (
    "in-part-write",  # half of a part's bytes are in its temporary file
    "before-part-rename",  # temporary part complete and fsynced, not yet renamed
    "after-part-rename",  # part visible, progress.json not yet updated
    "after-progress",  # part and progress.json committed
    "in-generate",  # between engine steps
    "before-done",  # last part committed, DONE.json not yet written
    "in-merge",  # merged output half written
)
_hits: Counter[str] = Counter()


def point(name: str) -> None:
    """Kill this process (and its group, when it leads one) if BATCHINFER_FAULT names this hit."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    want, _, nth = spec.partition(":")
    if want != name:
        return
    _hits[name] += 1
    if _hits[name] != int(nth or 1):
        return
    # Kill the engine processes with us, as a node failure or OOM killer would.
    if os.getpgid(0) == os.getpid():
        os.killpg(0, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
