"""Successive halving over settings, one engine start per setting and one engine alive at a time.

Settings run one after another; each runs rung after rung (larger, disjoint slices of the pilot)
while it stays in the better half of the results recorded at that rung so far (the asynchronous
form of successive halving: a rung's verdict never waits for a later setting, so no engine sits
idle holding its memory). A failure at start or at a rung is recorded, never raised."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional, Protocol

from batchinfer.tune.settings import Setting


@dataclass
class Rung:
    """One rung of one setting, from its run directory's DONE.json and output rows. With several
    engines (side by side, as in a task), generate_seconds is their engine-seconds over `engines`,
    so the score is the task's rate."""

    rung: int
    rows: int
    prompt_tokens: int
    output_tokens: int
    generate_seconds: float
    prefix_cache_hit_rate: Optional[float] = None
    peak_memory_mb: Optional[float] = None
    output_lengths: list[int] = field(default_factory=list)
    stopped_at_max_tokens: int = 0
    engines: int = 1
    startup_seconds: Optional[float] = None  # its engines' start-up, when they started for this rung

    @property
    def score(self) -> float:
        """What is compared: output tokens/s, or rows/s for a task that generates nothing."""
        if not self.generate_seconds:
            return 0.0
        return (self.output_tokens or self.rows) / self.generate_seconds


@dataclass
class Outcome:
    """Everything a setting's trial measured, or why it failed."""

    setting: Setting
    startup_seconds: Optional[float] = None
    rungs: list[Rung] = field(default_factory=list)
    failure: Optional[str] = None

    def _total(self, name: str) -> float:
        return sum(getattr(r, name) for r in self.rungs)

    @property
    def output_tokens_per_s(self) -> Optional[float]:
        """Steady output tokens/s over every rung's generate seconds (start-up excluded)."""
        gen = self._total("generate_seconds")
        return self._total("output_tokens") / gen if gen else None

    @property
    def rows_per_s(self) -> Optional[float]:
        """Steady rows/s over every rung's generate seconds."""
        gen = self._total("generate_seconds")
        return self._total("rows") / gen if gen else None

    @property
    def engines(self) -> int:
        """Engines its task ran side by side (cluster.engines_per_task; fewer only for a rung with
        fewer rows than engines)."""
        return max((r.engines for r in self.rungs), default=1)

    def per_engine(self, name: str) -> Optional[float]:
        """`output_tokens` or `rows` per engine-second of generation: one engine's steady rate
        while its task's engines run side by side, the rate forecast.point takes."""
        engine_seconds = sum(r.generate_seconds * r.engines for r in self.rungs)
        return self._total(name) / engine_seconds if engine_seconds else None


class TrialFailed(Exception):
    """A trial's engine was refused, failed, ran out of memory or over its time: the reason."""


class Trial(Protocol):
    """One setting's engine, started once, running rungs while told to go on."""

    def start(self, timeout: float) -> Optional[float]: ...  # start-up seconds; None: each rung starts its own

    def rung(self, index: int, timeout: float) -> Rung: ...

    def stop(self) -> None: ...


Launch = Callable[[Setting], Trial]


def in_better_half(score: float, others: list[float]) -> bool:
    """Whether score ranks within the better half (rounded up) of others plus itself."""
    rank = 1 + sum(1 for o in others if o > score)
    return rank <= math.ceil((len(others) + 1) / 2)


def halve(
    settings: list[Setting],
    rungs: int,
    launch: Launch,
    seconds: float,
    say: Callable[[str], None] = lambda _: None,
) -> list[Outcome]:
    """Run every setting on rung 0 and on later rungs while it stays in the better half; within
    `seconds` in all (a step gets what is left; settings not reached say so)."""
    deadline = time.monotonic() + seconds
    scores: list[dict[int, float]] = [{} for _ in range(rungs)]  # rung -> {setting index: score}
    outcomes = []
    for i, setting in enumerate(settings):
        out = Outcome(setting)
        outcomes.append(out)
        left = deadline - time.monotonic()
        if left <= 0:
            out.failure = "not tried: the --minutes budget was spent"
            say(f"[{i + 1}/{len(settings)}] {setting.name}: {out.failure}")
            continue
        say(f"[{i + 1}/{len(settings)}] {setting.name}: starting the engine")
        trial = launch(setting)
        try:
            out.startup_seconds = trial.start(left)
            for r in range(rungs):
                rung = trial.rung(r, max(1.0, deadline - time.monotonic()))
                out.rungs.append(rung)
                starts = [s.startup_seconds for s in out.rungs if s.startup_seconds is not None]
                if starts:  # engines started for each rung: the setting's start-up is their mean
                    out.startup_seconds = round(sum(starts) / len(starts), 2)
                say(f"[{i + 1}/{len(settings)}] {setting.name}: rung {r}, {rung.rows} rows, {rung.score:.1f}/s")
                peers = [s for j, s in scores[r].items() if settings[j].changes_outputs == setting.changes_outputs]
                scores[r][i] = rung.score
                if not in_better_half(rung.score, peers):
                    break
        except TrialFailed as e:
            out.failure = str(e)
            say(f"[{i + 1}/{len(settings)}] {setting.name}: failed: {e}")
        finally:
            trial.stop()
    return outcomes


def best(outcomes: list[Outcome]) -> Optional[Outcome]:
    """The winner: of the settings that keep outputs and did not fail, those that reached the
    highest rung, the fastest there; None when every setting failed."""
    fine = [o for o in outcomes if not o.setting.changes_outputs and o.failure is None and o.rungs]
    if not fine:
        return None
    top = max(len(o.rungs) for o in fine)
    return max((o for o in fine if len(o.rungs) == top), key=lambda o: o.rungs[-1].score)


def rung_sizes(rows: int, rungs: int) -> list[int]:
    """Pilot rows cut into rungs that double (rung r gets 2**r shares), each at least one row."""
    shares = [2**r for r in range(rungs)]
    sizes = [max(1, rows * s // sum(shares)) for s in shares]
    sizes[-1] = max(1, rows - sum(sizes[:-1]))
    return sizes


MAX_RUNGS = 3  # more would leave the first rung too few rows to rank settings by


def rungs_for(settings: int) -> int:
    """Rungs of successive halving: enough to halve the settings down to one, at most MAX_RUNGS."""
    return min(MAX_RUNGS, 1 + math.ceil(math.log2(settings))) if settings > 1 else 1
