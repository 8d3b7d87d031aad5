"""DIR/forecast.json: the forecast a run was submitted with (from a tune result), its record and
its one reader and writer. Part of the run directory: `submit`/`run` write it (tune/budget.py),
`report` reads it (insight/forecast_check.py), so the report does not depend on the tuner."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from batchinfer.errors import ConfigError

RECORD = "forecast.json"  # DIR/forecast.json
RECORD_VERSION = 1


@dataclass(frozen=True)
class Figure:
    """A forecast value and its interval."""

    value: float
    low: float
    high: float


@dataclass(frozen=True)
class RunForecast:
    """The forecast of one run: its rows and layout, from a tune result; what DIR/forecast.json holds."""

    source: str  # the tune.json path
    fingerprint: str
    created: str  # when the tune ran
    setting: Optional[str]
    tuned_overrides: list[str]
    tuned_settings_used: bool  # the run's config has the winner's settings
    rows: int
    layout: dict[str, int]
    price: Optional[float]
    price_source: Optional[str]
    figures: dict[str, Figure]


def write_record(run_path: Path, rf: RunForecast) -> Path:
    """DIR/forecast.json: the run's forecast, written whole."""
    from batchinfer.durable import write_json

    body = asdict(rf)
    body["figures"] = {k: {n: round(v, 6) for n, v in f.items()} for k, f in body["figures"].items()}
    write_json(run_path / RECORD, {"version": RECORD_VERSION, **body})
    return run_path / RECORD


def read_record(run_path: Path) -> Optional[RunForecast]:
    """DIR/forecast.json as a RunForecast; None when the run has none; ConfigError when unreadable."""
    path = run_path / RECORD
    if not path.is_file():
        return None
    try:
        r = json.loads(path.read_text(encoding="utf-8"))
        r.pop("version", None)
        r["figures"] = {k: Figure(**f) for k, f in r["figures"].items()}
        return RunForecast(**r)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{path}: unreadable ({type(e).__name__}: {e}); remove it or submit again") from None
