"""What an engine step costs, fitted on a setting's measured steps: seconds = per_step + per_decode x
(sequences decoding) + per_prefill x (prompt tokens computed), times the worker's overhead around
the steps. The pilot's steps run fewer sequences at once than the full run's (a 147-row rung cannot
fill 256 seats), so a rate (tokens per second) measured on the pilot does not carry over; the cost
of a step does, and the full run's steps come from replaying its batches (tune/batching.py)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

from batchinfer.tune.batching import Load

FEATURES = ("per_step", "per_decode", "per_prefill")


@dataclass
class StepStats:
    """One rung's steps as least squares needs them, features x = (1, decodes, prefill tokens) from
    the replay of its requests, y = a step's measured seconds: sums of x x', x y, y y; and the
    rung's totals (measured and replayed steps, seconds in steps, generate seconds)."""

    xtx: list[list[float]] = field(default_factory=lambda: [[0.0] * 3 for _ in range(3)])
    xty: list[float] = field(default_factory=lambda: [0.0] * 3)
    yty: float = 0.0
    steps: int = 0  # measured engine steps
    replayed: int = 0  # steps of the replay
    step_seconds: float = 0.0  # seconds inside the engine's steps
    generate_seconds: float = 0.0  # the rung's generate seconds (steps and the worker's work between them)
    requests: int = 0  # sent to the engine (identical rows share one)
    decodes: int = 0  # replayed decode tokens
    prefill: int = 0  # prompt tokens computed (prompt tokens minus prefix-cache hits)

    def add_step(self, x: Sequence[float], y: float) -> None:
        """One step: its features and measured seconds."""
        for i in range(3):
            self.xty[i] += x[i] * y
            for j in range(3):
                self.xtx[i][j] += x[i] * x[j]
        self.yty += y * y

    def __add__(self, o: StepStats) -> StepStats:
        return StepStats(
            xtx=[[a + b for a, b in zip(r, s, strict=True)] for r, s in zip(self.xtx, o.xtx, strict=True)],
            xty=[a + b for a, b in zip(self.xty, o.xty, strict=True)],
            yty=self.yty + o.yty,
            steps=self.steps + o.steps,
            replayed=self.replayed + o.replayed,
            step_seconds=self.step_seconds + o.step_seconds,
            generate_seconds=self.generate_seconds + o.generate_seconds,
            requests=self.requests + o.requests,
            decodes=self.decodes + o.decodes,
            prefill=self.prefill + o.prefill,
        )

    @property
    def load(self) -> Load:
        """The rung's totals: its measured steps, the replay's decode and prompt tokens."""
        return Load(self.steps, self.decodes, self.prefill)


def measure_steps(
    durations: Sequence[float], features: Sequence[tuple[int, int]], generate_seconds: float
) -> StepStats:
    """StepStats of a rung: measured step seconds paired in order with the replay's steps (a measured
    step past the replay's last counts as a step that did nothing: its seconds are the fixed cost)."""
    s = StepStats(steps=len(durations), replayed=len(features), generate_seconds=generate_seconds)
    for k, y in enumerate(durations):
        d, p = features[k] if k < len(features) else (0, 0)
        s.add_step((1.0, float(d), float(p)), y)
        s.step_seconds += y
    s.decodes = sum(d for d, _ in features)
    s.prefill = sum(p for _, p in features)
    return s


@dataclass(frozen=True)
class CostModel:
    """Seconds of a step = per_step + per_decode x decodes + per_prefill x prompt tokens computed;
    generate seconds = overhead x the steps' seconds (the worker's submitting and collecting)."""

    per_step: float
    per_decode: float
    per_prefill: float
    overhead: float = 1.0

    def seconds(self, load: Load) -> float:
        """Generate seconds of a run with these totals."""
        return self.overhead * (
            self.per_step * load.steps + self.per_decode * load.decodes + self.per_prefill * load.prefill
        )


def _solve(a: list[list[float]], b: list[float]) -> Optional[list[float]]:
    """a x = b by Gaussian elimination with partial pivoting; None when singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-12 * max(1.0, max(abs(v) for row in a for v in row)):
            return None
        m[c], m[p] = m[p], m[c]
        for r in range(n):
            if r != c:
                f = m[r][c] / m[c][c]
                m[r] = [x - f * y for x, y in zip(m[r], m[c], strict=True)]
    return [m[i][n] / m[i][i] for i in range(n)]


def _sse(s: StepStats, beta: Sequence[float]) -> float:
    """Sum of squared residuals of beta on s's steps."""
    quad = sum(beta[i] * s.xtx[i][j] * beta[j] for i in range(3) for j in range(3))
    return s.yty - 2 * sum(b * v for b, v in zip(beta, s.xty, strict=True)) + quad


def fit(s: StepStats) -> Optional[CostModel]:
    """The least-squares step cost with no negative coefficient (every subset of the features
    tried, the best fit kept); None without steps. A feature the steps never vary (no prefill
    apart from one step) gets 0 rather than noise."""
    if s.steps == 0 or s.step_seconds <= 0:
        return None
    best: Optional[tuple[float, list[float]]] = None
    for k in (3, 2, 1):
        for subset in itertools.combinations(range(3), k):
            sol = _solve([[s.xtx[i][j] for j in subset] for i in subset], [s.xty[i] for i in subset])
            if sol is None or any(v < 0 for v in sol):
                continue
            beta = [0.0] * 3
            for i, v in zip(subset, sol, strict=True):
                beta[i] = v
            err = _sse(s, beta)
            if best is None or err < best[0] - 1e-15:
                best = (err, beta)
    if best is None:
        return None
    beta = best[1]
    overhead = s.generate_seconds / s.step_seconds if s.generate_seconds > 0 else 1.0
    return CostModel(beta[0], beta[1], beta[2], max(1.0, overhead))


def relative_error(model: CostModel, rungs: Sequence[StepStats]) -> float:
    """The root mean square of (fitted - measured) / measured generate seconds over the rungs: how
    well the cost of a step explains each rung."""
    errs = [(model.seconds(r.load) - r.generate_seconds) / r.generate_seconds for r in rungs if r.generate_seconds > 0]
    return math.sqrt(sum(e * e for e in errs) / len(errs)) if errs else 0.0
