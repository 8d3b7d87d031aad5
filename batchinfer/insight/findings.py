"""What checking rows finds, as records that merge in row order: problems counted by kind with
their first examples, prompt token lengths, overlong rows."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, NotRequired, TypedDict

EXAMPLES = 5  # examples kept per kind of problem


class Example(TypedDict):
    """A row with a problem: its number, id, and what is wrong (a problem of the ids: what alone)."""

    row: NotRequired[int]
    id: NotRequired[Any]  # the input's id column's type
    message: str


class KindCount(TypedDict):
    """A kind of problem in the validate report: how often, and the first examples."""

    count: int
    examples: list[Example]


@dataclass
class Tally:
    """Counts and the first examples of each kind of problem."""

    kinds: dict[str, KindCount] = field(default_factory=dict)

    def add(self, kind: str, example: Example) -> None:
        """Count one problem of a kind, keeping it as an example while there are few."""
        entry = self.kinds.setdefault(kind, {"count": 0, "examples": []})
        entry["count"] += 1
        if len(entry["examples"]) < EXAMPLES:
            entry["examples"].append(example)

    def total(self) -> int:
        """Problems of every kind."""
        return sum(e["count"] for e in self.kinds.values())

    def merge(self, later: Tally) -> None:
        """Add the problems of rows that come after these: examples stay the first ones in row order."""
        for kind, theirs in later.kinds.items():
            entry = self.kinds.setdefault(kind, {"count": 0, "examples": []})
            entry["count"] += theirs["count"]
            entry["examples"] = (entry["examples"] + theirs["examples"])[:EXAMPLES]


@dataclass
class Checked:
    """What checking rows found: error rows, run-stopping problems, prompt token lengths, overlong rows."""

    errors: Tally = field(default_factory=Tally)
    stops: Tally = field(default_factory=Tally)
    lengths: Counter[int] = field(default_factory=Counter)
    overlong: int = 0

    def merge(self, later: Checked) -> None:
        """Add what was found in rows that come after these."""
        self.errors.merge(later.errors)
        self.stops.merge(later.stops)
        self.lengths.update(later.lengths)
        self.overlong += later.overlong
