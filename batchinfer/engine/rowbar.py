"""The progress bar of a shard loop: tqdm, with rows/s and the ETA from rows finished after the first
commit. The first rows of a batch finish only after the prefill of all of it, so tqdm's own estimate
from them is absurd (2 h 43 min for a 77-second job); before that commit none is shown."""

from __future__ import annotations

from typing import Any, Optional

from tqdm import tqdm


class RowBar(tqdm):  # type: ignore[type-arg]
    """tqdm whose rate counts only the rows since committed() was first called (eta_after_commit)."""

    def __init__(self, *args: Any, eta_after_commit: bool = False, **kwargs: Any):
        # (rows, time) at the first commit; None: no estimate yet. Without eta_after_commit, tqdm's own.
        self.since: Optional[tuple[float, float]] = None
        self.eta_after_commit = eta_after_commit
        super().__init__(*args, **kwargs)

    def committed(self) -> None:
        """Rows were committed: the rate is measured from the first time this is called."""
        if self.since is None:
            self.since = (self.n, self._time())

    @property
    def format_dict(self) -> dict[str, Any]:
        """tqdm's fields, with `rate` from the rows since the first commit (0: shown as `?`)."""
        d = super().format_dict
        if self.eta_after_commit:
            d["rate"] = self.steady_rate()
        return d

    def steady_rate(self) -> float:
        """Rows per second since the first commit; 0 before it, or before a row finished after it."""
        if self.since is None:
            return 0.0
        rows, t0 = self.since
        dt = self._time() - t0
        return (self.n - rows) / dt if dt > 0 and self.n > rows else 0.0
