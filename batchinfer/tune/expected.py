"""A run's expected figures from a tune result: find the tune.json made for this config (`--tune`,
the `tuned` config group's file, or the default tune folder), load it, and scale its forecast to
the run's own rows and layout. DIR/forecast.json records that forecast for `report`."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from batchinfer.config.schema import Config
from batchinfer.errors import ConfigError
from batchinfer.rundir.forecast_record import Figure, RunForecast
from batchinfer.tune.forecast import Measured, point
from batchinfer.tune.results import GROUP, TUNE_RESULT_LINE

# `+tuned=best`, `tuned=best`, `++tuned=best`: the tuned config group on the command line
GROUP_OVERRIDE = re.compile(rf"\+{{0,2}}{GROUP}=([\w.-]+)")


@dataclass(frozen=True)
class TuneResult:
    """What a tune.json says about its winner, per row, so it scales to any run of its config."""

    path: Path
    fingerprint: str
    created: str
    overrides: list[str]  # the tune's own command-line overrides
    setting: Optional[str]  # the winner's name; None when no setting finished
    best_overrides: list[str]
    rows: int  # the rows its forecast was made for
    output_per_row: Figure  # mean output tokens per row, with the bootstrap interval
    generate_per_row: Figure  # engine seconds per row while generating, with the interval
    startup_seconds: float
    price: Optional[float]
    price_source: Optional[str]
    has_forecast: bool


@dataclass(frozen=True)
class Lookup:
    """Where the tune result was found (path None: nowhere) and every place looked."""

    path: Optional[Path]
    how: str = ""
    looked: list[str] = field(default_factory=list)


def _figure(rec: Any, per: float, where: str) -> Figure:
    try:
        return Figure(*(float(rec[k]) / per for k in ("value", "low", "high")))
    except (KeyError, TypeError, ValueError):
        raise ConfigError(f"{where}: not a forecast figure ({{value, low, high}}): {rec!r}") from None


def load_tune(path: Path) -> TuneResult:
    """Read a tune.json; ConfigError naming the file and the key when it is not one."""
    try:
        r = json.loads(path.read_text(encoding="utf-8"))
        fc, best = r["forecast"], r["best"]
        rows = int(r["layout"]["rows"])
        fingerprint = str(r["fingerprint"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"{path}: not a readable tune.json ({type(e).__name__}: {e}); run `batchinfer tune` again"
        ) from None
    winner = next((s for s in r.get("settings", []) if s.get("name") == best.get("name")), {})
    price = r.get("price") or {}
    zero = Figure(0.0, 0.0, 0.0)
    per = max(rows, 1)
    return TuneResult(
        path=path.resolve(),
        fingerprint=fingerprint,
        created=str(r.get("created", "")),
        overrides=list(r.get("overrides") or []),
        setting=best.get("name"),
        best_overrides=list(best.get("overrides") or []),
        rows=rows,
        output_per_row=_figure(fc["output_tokens"], per, f"{path}: forecast.output_tokens") if fc else zero,
        generate_per_row=_figure(fc["generate_seconds"], per, f"{path}: forecast.generate_seconds") if fc else zero,
        startup_seconds=float(winner.get("startup_seconds") or 0.0),
        price=price.get("usd_per_gpu_hour"),
        price_source=price.get("source"),
        has_forecast=bool(fc),
    )


def group_tune_json(group_file: Path) -> Path:
    """The tune.json a `tuned` group file came from: its `# tune result:` line, else TUNE/tune.json
    beside TUNE/conf/tuned/ (a group file written before the line was)."""
    for line in group_file.read_text(encoding="utf-8").splitlines():
        if line.startswith(TUNE_RESULT_LINE):
            return Path(line[len(TUNE_RESULT_LINE) :].strip())
    return group_file.parent.parent.parent / "tune.json"


def find_tune(
    explicit: Optional[str], overrides: list[str], config_dir: Optional[str], input_path: str, fp: str
) -> Lookup:
    """--tune DIR|FILE, else the selected `tuned` group's tune.json, else the default tune folder's."""
    from batchinfer.tune.command import default_folder

    if explicit:
        p = Path(explicit)
        path = p / "tune.json" if p.is_dir() else p
        if not path.is_file():
            raise ConfigError(f"--tune {explicit}: no tune.json there; pass the folder `batchinfer tune` wrote")
        return Lookup(path, "--tune", [str(path)])
    looked = []
    chosen = [m[1] for m in map(GROUP_OVERRIDE.fullmatch, overrides) if m]
    if chosen and config_dir:
        group_file = Path(config_dir) / GROUP / f"{chosen[-1]}.yaml"
        if group_file.is_file():
            path = group_tune_json(group_file)
            if path.is_file():
                return Lookup(path, f"+{GROUP}={chosen[-1]}", [str(path)])
            looked.append(f"{path} (named by {group_file})")
    path = default_folder(input_path, fp) / "tune.json"
    if path.is_file():
        return Lookup(path, "the default tune folder", [*looked, str(path)])
    return Lookup(None, "", [*looked, f"{path} (the default tune folder, under {Path.cwd()})"])


def uses_settings(config: dict[str, Any], overrides: list[str]) -> bool:
    """Whether the run's resolved config has every one of the winner's `key=value` settings."""
    from omegaconf import OmegaConf

    have = OmegaConf.create(config)
    for ov in overrides:
        key = ov.split("=", 1)[0].lstrip("+")
        want = OmegaConf.select(OmegaConf.from_dotlist([ov.lstrip("+")]), key)
        if OmegaConf.select(have, key, default=None) != want:
            return False
    return True


def run_forecast(
    tune: TuneResult, c: Config, config: dict[str, Any], rows: int, price: Optional[float], source: Optional[str]
) -> RunForecast:
    """The tune's forecast for this run: per-row output tokens and engine seconds times its rows,
    engine starts and GPUs from its own layout (cluster settings are outside the fingerprint), and
    the winner's steady rate and start-up; the same arithmetic as tune's forecast (forecast.point)."""
    from batchinfer.tune.command import layout

    shape = layout(c, rows)
    out, gen = tune.output_per_row, tune.generate_per_row
    generates = out.value > 0
    rate = (out.value / gen.value if generates else 1 / gen.value) if gen.value else 0.0
    measured = Measured([], rate, tune.startup_seconds, generates)
    points = [point(shape, measured, mean, price) for mean in (out.value, out.low, out.high)]
    figures = {k: Figure(*(p[k] for p in points)) for k in points[0]}
    rate_key = "output_tokens_per_s" if generates else "rows_per_s"
    figures[rate_key] = Figure(rate, rate, rate)
    return RunForecast(
        source=str(tune.path),
        fingerprint=tune.fingerprint,
        created=tune.created,
        setting=tune.setting,
        tuned_overrides=tune.best_overrides,
        tuned_settings_used=uses_settings(config, tune.best_overrides),
        rows=rows,
        layout=asdict(shape),
        price=price,
        price_source=source,
        figures=figures,
    )
