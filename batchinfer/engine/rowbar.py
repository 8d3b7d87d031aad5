"""The progress bar of a shard loop: tqdm, shown from the moment the engine is ready (its clock starts
there, once), with rows/s and the ETA only from the first commit on. The first rows of a batch finish
only after the prefill of all of it, so tqdm's own estimate from them is absurd (2 h 43 min for a
77-second job), and so is one from the few rows finished just after a commit (6.99 s/row at 525 of
722 rows done in 62 s): from the first commit on, the rate is every row finished here over the time
since the engine was ready. Not on a terminal (a Slurm log, `> log 2>&1`) it writes plain lines,
one per state, never a carriage-return redraw: log lines stay on their own lines."""

from __future__ import annotations

from typing import Any, Optional

from tqdm import tqdm


class RowBar(tqdm):  # type: ignore[type-arg]
    """tqdm that, with eta_after_commit, stays hidden until ready() (the engine is ready: the clock
    starts there) and shows rows/s and the ETA only once committed() was called. plain: one line per
    state drawn (no redraw with \r), for a stream that is not a terminal."""

    def __init__(self, *args: Any, eta_after_commit: bool = False, plain: bool = False, **kwargs: Any):
        self.eta_after_commit = eta_after_commit
        self.plain = plain
        self.plain_n: Optional[float] = None  # rows of the last plain line: a redraw without progress writes none
        self.is_ready = not eta_after_commit  # False: the engine is starting; nothing is drawn
        self.has_committed = False
        super().__init__(*args, **kwargs)

    def ready(self) -> None:
        """The engine is ready: the bar's clock starts now (the first call only) and it is drawn."""
        if self.is_ready:
            return
        self.is_ready = True
        self.start_t = self.last_print_t = self._time()
        self.refresh()

    def committed(self) -> None:
        """Rows were committed: from now on the bar shows rows/s and the ETA."""
        self.has_committed = True

    def count_done(self, rows: int) -> None:
        """Rows committed before this process (a shard added while running): counted in the bar,
        not in its rate."""
        self.initial += rows
        self.update(rows)

    def display(self, msg: Any = None, pos: Any = None) -> Any:
        """tqdm's drawing, skipped until the engine is ready (log lines redraw the bar meanwhile)."""
        if not self.is_ready:
            return None
        if self.plain:
            return self.plain_line(msg)
        return super().display(msg, pos)

    def plain_line(self, msg: Any) -> bool:
        """The bar's state on a line of its own; nothing when no row was done since the last line (a
        log line written meanwhile redraws the bar) or when tqdm clears (msg '': nothing to clear)."""
        if msg == "" or (msg is None and self.n == self.plain_n):
            return False
        self.plain_n = self.n
        self.fp.write(f"{self if msg is None else msg}\n")
        self.fp.flush()
        return True

    def clear(self, nolock: bool = False) -> None:
        """tqdm's clearing of its line (before a log line), skipped while nothing is drawn (and in
        plain lines, which a log line follows)."""
        if self.is_ready and not self.plain:
            super().clear(nolock)

    def close(self) -> None:
        """tqdm's close; a bar never drawn (the engine did not start) leaves no empty line."""
        if not self.is_ready:
            self.leave = False
        elif self.plain and not self.disable:
            self.display()  # the final state, unless the last line showed it
            self.leave = False  # tqdm would add an empty line
        super().close()

    @property
    def format_dict(self) -> dict[str, Any]:
        """tqdm's fields with `rate`: the rows finished here over the time since the engine was
        ready, once a commit was made; 0 (shown as `?`) before."""
        d = super().format_dict
        if self.eta_after_commit:
            d["rate"] = self.steady_rate(d["n"] - d["initial"], d["elapsed"])
        return d

    def steady_rate(self, rows: float, elapsed: float) -> float:
        """Rows per second since the engine was ready; 0 before the first commit."""
        if not (self.has_committed and self.is_ready) or elapsed <= 0 or rows <= 0:
            return 0.0
        return rows / elapsed
