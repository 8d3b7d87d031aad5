"""`submit --max-gpu-hours H` / `--max-cost USD` and `--tune DIR`: before any sbatch, the run's
forecast from its tune result (tune/expected.py) is checked against the budget and recorded in
DIR/forecast.json, so `report DIR` can set the measured figures beside it."""

from __future__ import annotations

import argparse
import logging
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

from batchinfer.errors import ConfigError, SubmissionRefused
from batchinfer.rundir.forecast_record import Figure, RunForecast, write_record
from batchinfer.rundir.store import RunDir
from batchinfer.tune.expected import (
    GROUP_OVERRIDE,
    Lookup,
    TuneResult,
    find_tune,
    load_tune,
    run_forecast,
)

log = logging.getLogger("batchinfer")


@dataclass(frozen=True)
class ForecastOptions:
    """What `run`/`submit` were given that decides the forecast and the budget."""

    command: str  # run | submit
    overrides: list[str]
    config_dir: Optional[str] = None
    tune: Optional[str] = None
    max_gpu_hours: Optional[float] = None
    max_cost: Optional[float] = None
    price: Optional[float] = None
    gpu: Optional[str] = None

    @property
    def budgeted(self) -> bool:
        """A budget was asked for: then a forecast is required."""
        return self.max_gpu_hours is not None or self.max_cost is not None


def add_tune_option(p: argparse.ArgumentParser) -> None:
    """--tune DIR (run and submit)."""
    p.add_argument(
        "--tune",
        metavar="DIR",
        help="the tune folder (or its tune.json) whose forecast this run records (default: the `+tuned=` "
        "group's, else runs/tune-<input stem>-<fingerprint[:8]> when it exists)",
    )


def add_budget_options(p: argparse.ArgumentParser) -> None:
    """--tune, --max-gpu-hours, --max-cost, --gpu-hour-price, --gpu (submit)."""
    add_tune_option(p)
    p.add_argument("--max-gpu-hours", type=float, metavar="H", help="refuse when the forecast is over H GPU-hours")
    p.add_argument("--max-cost", type=float, metavar="USD", help="refuse when the forecast cost is over USD")
    p.add_argument("--gpu-hour-price", type=float, metavar="USD", help="price of one GPU-hour (default: tune's)")
    p.add_argument("--gpu", metavar="PRESET", help="price from a GPU preset's assumed list price (H100-80GB, ...)")


def options(args: argparse.Namespace) -> ForecastOptions:
    """The forecast options of a parsed `run` or `submit` command line; budgets checked positive."""
    opts = ForecastOptions(
        command=args.command,
        overrides=list(args.overrides),
        config_dir=args.config_dir,
        tune=getattr(args, "tune", None),
        max_gpu_hours=getattr(args, "max_gpu_hours", None),
        max_cost=getattr(args, "max_cost", None),
        price=getattr(args, "gpu_hour_price", None),
        gpu=getattr(args, "gpu", None),
    )
    for flag, value in (("--max-gpu-hours", opts.max_gpu_hours), ("--max-cost", opts.max_cost)):
        if value is not None and not value > 0:
            raise ConfigError(f"{flag} {value}: must be positive")
    return opts


def hook(args: argparse.Namespace) -> Callable[[RunDir], None]:
    """What run/submit call once DIR is prepared, before any engine or sbatch."""
    opts = options(args)
    return lambda run: expect(run, opts)


def expect(run: RunDir, opts: ForecastOptions) -> Optional[RunForecast]:
    """Find this config's tune result, scale its forecast to the run, refuse when it is over the
    budget (SubmissionRefused: nothing submitted), else record DIR/forecast.json and say it."""
    fp = run.run["fingerprint"]
    found = find_tune(opts.tune, opts.overrides, opts.config_dir, run.config.input.path, fp)
    if found.path is None:
        if opts.budgeted:
            raise SubmissionRefused(no_tune(opts, fp, run.config.input.path, found))
        return None
    tune = load_tune(found.path)
    problem = mismatch(tune, fp, opts) or (None if tune.has_forecast else no_forecast(tune))
    if problem:
        if opts.budgeted:
            raise SubmissionRefused(f"{budget_flags(opts)}: {problem}; nothing was submitted")
        log.warning("no forecast recorded for %s: %s", run.path, problem)
        return None
    price, source = _price(opts, tune)
    rows = sum(s.rows for s in run.shards())
    rf = run_forecast(tune, run.config, run.run["config"], rows, price, source)
    check_budget(rf, opts)
    write_record(run.path, rf)
    print(summary(rf, found))
    if not rf.tuned_settings_used:
        print(
            f"  note: the forecast is for the tune's winning settings ({' '.join(rf.tuned_overrides)}), which this "
            f"config does not use: add `--config-dir {tune.path.parent / 'conf'} +tuned=best`"
        )
    return rf


def _price(opts: ForecastOptions, tune: TuneResult) -> tuple[Optional[float], Optional[str]]:
    """--gpu-hour-price, else --gpu's preset, else the price the tune recorded."""
    from batchinfer.insight.cost import hourly_price

    price, source = hourly_price(opts.price, opts.gpu)
    if price is None and tune.price is not None:
        return tune.price, f"{tune.price_source} (recorded by the tune)"
    return price, source


def check_budget(rf: RunForecast, opts: ForecastOptions) -> None:
    """SubmissionRefused when the forecast value is over a budget; a warning when only its interval is."""
    checks = []
    if opts.max_gpu_hours is not None:
        checks.append(("--max-gpu-hours", opts.max_gpu_hours, rf.figures["gpu_hours"], "GPU-hours"))
    if opts.max_cost is not None:
        if "cost_usd" not in rf.figures:
            raise SubmissionRefused(
                f"--max-cost {opts.max_cost:g}: no GPU-hour price for the forecast ({rf.source} records none); pass "
                f"--gpu-hour-price USD or --gpu PRESET (or tune with --gpu-hour-price); nothing was submitted"
            )
        checks.append(("--max-cost", opts.max_cost, rf.figures["cost_usd"], "USD"))
    for flag, limit, fig, unit in checks:
        if fig.value > limit:
            raise SubmissionRefused(
                f"{flag} {limit:g}: the forecast for this run is {_fig(fig, unit)}, over the budget; nothing was "
                f"submitted. {_where(rf)}. Lower the work (fewer rows, a lower sampling.max_tokens) or raise {flag}"
            )
        if fig.high > limit:
            log.warning(
                "%s %g: within the forecast's interval (%s); the run may cost more", flag, limit, _fig(fig, unit)
            )


def _fig(f: Figure, unit: str) -> str:
    return f"{f.value:,.4g} {unit} (95% interval {f.low:,.4g} .. {f.high:,.4g})"


def _where(rf: RunForecast) -> str:
    """Where the forecast came from and the run it was scaled to."""
    lay = rf.layout
    price = f", at {rf.price:g} USD per GPU-hour ({rf.price_source})" if rf.price is not None else ""
    return (
        f"Forecast from {rf.source} (tune of {rf.created}, setting {rf.setting}) for this run: {rf.rows:,} rows, "
        f"{lay['array_tasks']} array tasks x {lay['engines_per_task']} engines of {lay['devices_per_engine']} "
        f"GPU(s){price}"
    )


def summary(rf: RunForecast, found: Lookup) -> str:
    """The forecast line run/submit print."""
    f = rf.figures
    cost = f"; cost {_fig(f['cost_usd'], 'USD')}" if "cost_usd" in f else ""
    return (
        f"forecast from {rf.source} ({found.how}): {_fig(f['gpu_hours'], 'GPU-hours')}{cost}; "
        f"output tokens {f['output_tokens'].value:,.0f}; recorded in forecast.json"
    )


def budget_flags(opts: ForecastOptions) -> str:
    """The budget options as typed, for messages."""
    flags = [("--max-gpu-hours", opts.max_gpu_hours), ("--max-cost", opts.max_cost)]
    return " ".join(f"{k} {v:g}" for k, v in flags if v is not None)


def tune_command(opts: ForecastOptions) -> str:
    """`batchinfer tune` with this command's overrides (the tuned group left out)."""
    overrides = [o for o in opts.overrides if not GROUP_OVERRIDE.fullmatch(o)]
    tuned = len(overrides) < len(opts.overrides)
    config_dir = ["--config-dir", opts.config_dir] if opts.config_dir and not tuned else []
    return shlex.join(["batchinfer", "tune", *config_dir, *overrides])


def no_tune(opts: ForecastOptions, fp: str, input_path: str, found: Lookup) -> str:
    """Why there is no forecast and how to make one."""
    from batchinfer.tune.command import default_folder

    folder = default_folder(input_path, fp)
    return (
        f"{budget_flags(opts)}: no tune result for this config (fingerprint {fp[:8]}); looked for "
        f"{'; '.join(found.looked)}. Nothing was submitted. Make one with `{tune_command(opts)}` (it writes "
        f"{folder}/, where submit finds it when run from this folder; elsewhere pass --tune DIR), then submit "
        f"again with `--config-dir {folder}/conf +tuned=best` to run its fastest settings"
    )


def mismatch(tune: TuneResult, fp: str, opts: ForecastOptions) -> Optional[str]:
    """None when the tune result is for this config; else why not and what to do."""
    if tune.fingerprint == fp:
        return None
    return (
        f"{tune.path} is a tune result for another config (fingerprint {tune.fingerprint[:8]}, overrides "
        f"{shlex.join(tune.overrides) or 'none'}; this config: {fp[:8]}): an output-changing key differs "
        f"(throughput settings do not count). Tune this config: `{tune_command(opts)}`"
    )


def no_forecast(tune: TuneResult) -> str:
    """A tune whose settings all failed has no forecast."""
    return f"{tune.path} has no forecast (no setting finished in that tune; see its tune.md): tune again"
