"""Successive halving over settings, one engine start per setting and one engine alive at a time.

Settings run one after another; each runs rung after rung (larger, disjoint slices of the pilot)
while it stays in the better half of the results recorded at that rung so far (the asynchronous
form of successive halving: a rung's verdict never waits for a later setting, so no engine sits
idle holding its memory). A failure at start or at a rung is recorded, never raised.

The same setting measured twice differs (13% on a loaded 2-core machine), so a setting faster than
the config as composed is repeated, each time on a fresh engine, with the config as composed, on the
top rung's rows, until their measurements separate (choose); part of the budget is kept for that."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from batchinfer.tune.batching import Limits
from batchinfer.tune.costmodel import StepStats
from batchinfer.tune.settings import Setting

MAX_REPEATS = 2  # fresh-engine repeats of the leader and of the config as composed, each


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
    steps: Optional[StepStats] = None  # its engine's steps, timed (one engine in the trial's process)
    limits: Optional[Limits] = None  # that engine's batching

    @classmethod
    def from_json(cls, msg: dict[str, Any]) -> Rung:
        """A rung as a trial's JSON line gives it."""
        steps, limits = msg.pop("steps", None), msg.pop("limits", None)
        return cls(
            **msg,
            steps=StepStats(**steps) if steps else None,
            limits=Limits(**limits) if limits else None,
        )

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
    repeats: list[Rung] = field(default_factory=list)  # its top rung again, each on a fresh engine

    def measures(self) -> list[float]:
        """Its scores at its top rung: the rung and its repeats."""
        return [self.rungs[-1].score, *(r.score for r in self.repeats)] if self.rungs else []

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
    repeats: int = MAX_REPEATS,
) -> list[Outcome]:
    """Run every setting on rung 0 and on later rungs while it stays in the better half, then repeat
    the leader and the config as composed (the first setting) up to `repeats` times each until they
    separate (confirm); within `seconds` in all (a step gets what is left; settings not reached say
    so). After the first setting, a new one starts only while the time left exceeds two of the first
    setting's trials (what one repeat of each costs), and its trial gets only the time above that."""
    deadline = time.monotonic() + seconds
    scores: list[dict[int, float]] = [{} for _ in range(rungs)]  # rung -> {setting index: score}
    outcomes = []
    reserve = 0.0
    for i, setting in enumerate(settings):
        out = Outcome(setting)
        outcomes.append(out)
        left = deadline - time.monotonic()
        if left <= 0 or (i > 0 and repeats > 0 and left <= reserve):
            out.failure = (
                "not tried: the --minutes budget was spent"
                if left <= 0
                else "not tried: the rest of the --minutes budget is kept to repeat the fastest"
            )
            say(f"[{i + 1}/{len(settings)}] {setting.name}: {out.failure}")
            continue
        t_trial = time.monotonic()
        # a later setting's trial gets the time above the reserve only: a slow one cannot eat the repeats'
        own = deadline - (reserve if i > 0 and repeats > 0 else 0.0)
        say(f"[{i + 1}/{len(settings)}] {setting.name}: starting the engine")
        trial = launch(setting)
        try:
            out.startup_seconds = trial.start(own - time.monotonic())
            for r in range(rungs):
                rung = trial.rung(r, max(1.0, own - time.monotonic()))
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
        if i == 0:
            reserve = 2 * (time.monotonic() - t_trial)
    if repeats > 0:
        confirm(outcomes, launch, deadline, repeats, say)
    return outcomes


def _repeat(out: Outcome, launch: Launch, deadline: float, say: Callable[[str], None]) -> bool:
    """The setting's top rung once more on a fresh engine; False when it failed or time is out."""
    left = deadline - time.monotonic()
    if left <= 0:
        return False
    top = len(out.rungs) - 1
    say(f"repeat {out.setting.name}: rung {top} on a fresh engine")
    trial = launch(out.setting)
    try:
        trial.start(left)
        rung = trial.rung(top, max(1.0, deadline - time.monotonic()))
    except TrialFailed as e:
        say(f"repeat {out.setting.name}: failed: {e}")
        return False
    finally:
        trial.stop()
    out.repeats.append(rung)
    say(f"repeat {out.setting.name}: rung {top}, {rung.rows} rows, {rung.score:.1f}/s")
    return True


def confirm(outcomes: list[Outcome], launch: Launch, deadline: float, repeats: int, say: Callable[[str], None]) -> None:
    """Repeat the leader (best) and the config as composed (the first setting), one each in turn,
    until their measurements separate, `repeats` more each at most, or time is out."""
    leader, base = best(outcomes), baseline(outcomes)
    if leader is None or base is None or leader is base or len(base.rungs) < len(leader.rungs):
        return
    for _ in range(repeats):
        if separated(leader.measures(), base.measures()):
            return
        if not (_repeat(leader, launch, deadline, say) and _repeat(base, launch, deadline, say)):
            return


def baseline(outcomes: list[Outcome]) -> Optional[Outcome]:
    """The config as composed (the setting of no overrides; without one, the first tried: the first
    --try) when it finished its rungs."""
    plain = [o for o in outcomes if not o.setting.overrides and not o.setting.env]
    first = plain[0] if plain else outcomes[0] if outcomes else None
    ok = first is not None and not first.setting.changes_outputs and first.failure is None and first.rungs
    return first if ok else None


def separated(faster: list[float], slower: list[float]) -> bool:
    """Whether two settings' measurements of one rung separate: each measured twice or more, every
    one of faster's above every one of slower's, and their means further apart than either's own
    spread (its largest minus smallest over its mean)."""
    if len(faster) < 2 or len(slower) < 2 or min(faster) <= max(slower):
        return False
    mf, ms = sum(faster) / len(faster), sum(slower) / len(slower)
    spread = max((max(faster) - min(faster)) / mf, (max(slower) - min(slower)) / ms)
    return mf / ms - 1 > spread


def noise(outcomes: list[Outcome]) -> Optional[float]:
    """The tune's own noise: the largest relative spread ((max - min) / mean) of one setting's
    measurements of one rung; None when nothing was measured twice."""
    spreads = []
    for o in outcomes:
        m = o.measures()
        if len(m) >= 2 and sum(m) > 0:
            spreads.append((max(m) - min(m)) / (sum(m) / len(m)))
    return max(spreads) if spreads else None


@dataclass(frozen=True)
class Choice:
    """The setting the tune recommends and why."""

    winner: Optional[Outcome]
    leader: Optional[Outcome]  # the fastest measured (best)
    reason: str


def _scores(xs: list[float]) -> str:
    return ", ".join(f"{x:,.1f}" for x in xs)


def choose(outcomes: list[Outcome]) -> Choice:
    """The leader when it separated from the config as composed, else the config as composed, saying
    why: a faster measurement inside the tune's own noise is no reason to change settings."""
    leader, base = best(outcomes), baseline(outcomes)
    if leader is None:
        return Choice(None, None, "no setting finished")
    if base is None or leader is base:
        why = "the fastest measured" if leader is base else "the config as composed did not finish its rungs"
        return Choice(leader, leader, why)
    lm, bm = leader.measures(), base.measures()
    gain = (sum(lm) / len(lm)) / (sum(bm) / len(bm)) - 1
    said = f"{leader.setting.name} [{_scores(lm)}] against {base.setting.name} [{_scores(bm)}] per second"
    if separated(lm, bm):
        return Choice(leader, leader, f"{gain:.0%} faster, measurements separate: {said}")
    if len(lm) < 2 or len(bm) < 2:
        why = f"{gain:.0%} faster once, not repeated (no time left to): {said}; keeping {base.setting.name}"
    else:
        why = f"{gain:+.0%} on average, inside the tune's own noise: {said}; keeping {base.setting.name}"
    return Choice(base, leader, why)


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
