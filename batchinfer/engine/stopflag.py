"""The worker's stop signals: handlers that only record them, checked between engine steps."""

from __future__ import annotations

import logging
import signal
from typing import Any, Optional

from batchinfer.errors import Stopped
from batchinfer.stopsignals import STOP_SIGNALS

log = logging.getLogger("batchinfer")


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

    def check(self) -> None:
        """Raise Stopped if a stop signal is pending (and log what arrived)."""
        if self.signum is not None:
            self.announce()
            raise Stopped(self.signum)
