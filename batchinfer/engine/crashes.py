"""Rows in flight at engine deaths: counted as suspects in the shard's record, run one at a time at
the next attempt, and an error row once a row (or a request identical to it) killed the engine
CRASHES_TO_ISOLATE times, so one row that kills the engine cannot keep its shard from finishing."""

from __future__ import annotations

from typing import Any

from batchinfer.requests.request import ErrorRow, Made, Request, RequestKey
from batchinfer.rundir.progress import Progress
from batchinfer.rundir.schema import OutputRow, error_row

CRASHES_TO_ISOLATE = 2  # engine deaths with a row in flight before that row becomes an error row


class Crashes:
    """What earlier engine deaths left in a shard's record, read once at the start of an attempt."""

    def __init__(self, record: Progress):
        suspects = record.suspects
        # in flight at CRASHES_TO_ISOLATE deaths (the last one alone): error rows now
        self.crashed_rows = sorted(r for r, n in suspects.items() if n >= CRASHES_TO_ISOLATE)
        # in flight at fewer: run one at a time before the rest of the shard
        self.isolated = sorted(r for r, n in suspects.items() if n < CRASHES_TO_ISOLATE)
        # requests the engine died on alone: an identical one anywhere in the shard is an error row at once
        self.requests = {bytes.fromhex(d): r for d, r in record.crashed.items()}

    def unless_crashed(self, made: Made) -> Made:
        """A request identical to one the engine died on alone is an error row at once: fed again,
        it would cost CRASHES_TO_ISOLATE more engine deaths."""
        if not self.requests or not isinstance(made, Request):
            return made
        crashed = self.requests.get(made.key.digest())
        if crashed is None:
            return made
        base = made.base
        msg = (
            f"row {base['row']}: its request is identical to row {crashed}'s, which the engine died on "
            f"{CRASHES_TO_ISOLATE} times (the second time alone); it is left out so the shard can finish"
        )
        return ErrorRow(dict(error_row(base["row"], base["id"], "engine_crash", msg), **base))


def crash_row(index: int, id_: Any, carried: OutputRow) -> OutputRow:
    """The error row of a row that was in flight at CRASHES_TO_ISOLATE engine deaths."""
    msg = (
        f"row {index}: the engine died {CRASHES_TO_ISOLATE} times while this row was in flight "
        f"(the second time alone); it is left out so the shard can finish. Check the Slurm log "
        f"for the engine's error (out of memory, a kernel fault), or run this row alone"
    )
    return dict(error_row(index, id_, "engine_crash", msg), **carried)


def count_suspects(record: Progress, in_flight: list[tuple[OutputRow, RequestKey]]) -> None:
    """An engine failure with these (output base, request) in flight: each row is a suspect once
    more, and a request in flight at its CRASHES_TO_ISOLATE-th death is recorded as crashed."""
    for base, key in in_flight:
        n = record.suspects[base["row"]] = record.suspects.get(base["row"], 0) + 1
        if n >= CRASHES_TO_ISOLATE:
            record.crashed.setdefault(key.digest().hex(), base["row"])
