"""When a worker commits the rows it finished: the one rule, for every shard attempt.

A SIGKILL (a node failure, an OOM kill) loses the finished rows not yet committed, so the window is
set in seconds of work, `output.commit_every_seconds`: what a kill costs, whatever the engine's
speed. `output.commit_every_rows` caps the rows held between commits. Each commit costs fsyncs and
leaves a part: a window's part waits for at least 1/PARTS_PER_SHARD of its shard's rows, so a shard
leaves at most ~PARTS_PER_SHARD parts for compaction (plus one per interrupted attempt), but never
longer than LONGEST_WINDOW_S (a shard slower than that leaves one part a minute, as before)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PARTS_PER_SHARD = 64
# The longest a finished row waits for its commit (the window before issue 44 was 60 s).
LONGEST_WINDOW_S = 60.0


@dataclass(frozen=True)
class CommitPolicy:
    """Commit at `every_rows` rows; after `every_seconds` once `min_rows` rows wait; after `longest_s`
    whatever waits."""

    every_rows: int
    every_seconds: float
    min_rows: int
    longest_s: float

    @classmethod
    def for_shard(cls, output: Any, shard_rows: int) -> CommitPolicy:
        """The policy of a shard of shard_rows rows under output (the run's OutputConfig)."""
        least = max(1, min(-(-shard_rows // PARTS_PER_SHARD), output.commit_every_rows))
        every = output.commit_every_seconds
        return cls(output.commit_every_rows, every, least, max(every, LONGEST_WINDOW_S))

    def due(self, pending: int, since_commit: float) -> bool:
        """Whether `pending` finished rows, `since_commit` seconds after the last commit, are committed now."""
        if pending >= self.every_rows:
            return True
        if pending >= self.min_rows and since_commit >= self.every_seconds:
            return True
        return pending > 0 and since_commit >= self.longest_s
