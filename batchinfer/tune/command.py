"""`batchinfer tune`: pilot, trials, winner, forecast; the tune folder and what is printed."""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import os
import re
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig

from batchinfer import ownership, security
from batchinfer.config.schema import DEFAULT_ROWS_PER_SHARD, POOLING_TASKS, to_config
from batchinfer.durable import write_record
from batchinfer.errors import ConfigError, FolderRefused
from batchinfer.redaction import redact_text
from batchinfer.tune import results
from batchinfer.tune.forecast import Layout, Measured, as_json, forecast, output_distribution
from batchinfer.tune.halving import Outcome, choose, halve, noise, rung_sizes, rungs_for
from batchinfer.tune.process import TrialProcess
from batchinfer.tune.sample import Prompts, draw_pilot, duplicate_share, quantiles, read_prompts, write_rows
from batchinfer.tune.settings import Setting, default_grid, parse_include, parse_tries

log = logging.getLogger("batchinfer")
TUNE_VERSION = 1
TUNE = "tune"  # the command a tune folder's mark names (ownership.py)
MIN_PILOT_ROWS = 8
# What a tune makes at the top of its folder, older versions' included (ownership.claim): all a
# failed tune, or one adopting a killed tune's folder, may remove; any other name is the user's.
TUNE_LAYOUT = ownership.Layout(
    "tune folder",
    (
        "pilot.parquet",
        "rungs",
        "trials",
        "tune.json",
        ".tune.json.tmp",
        "tune.md",
        "tune.png",
        "conf",  # conf/tuned/best.yaml, the winner as a config group
        "job.json",  # `tune ... cluster=slurm`: the tune job's record (tune/job.py) and its logs
        ".job.json.tmp",
        "logs",
        # durable.write_record's temporaries of the records above (a kill while one is written)
        ".tmp-tune.json.*",
        ".tmp-tune.md.*",
        ".tmp-job.json.*",
    ),
)
# What a finished older tune (no owner's mark) always made: a folder lacking any is not one.
_OLDER_TUNE_MADE = ("pilot.parquet", "rungs", "trials", "tune.md")


@dataclass
class Options:
    """The command line of `batchinfer tune` beyond the overrides."""

    overrides: list[str]
    config_dir: Optional[str] = None
    rows: int = 256
    minutes: float = 30.0
    seed: int = 0
    include: Optional[str] = None
    tries: list[str] = field(default_factory=list)
    price: Optional[float] = None
    out: Optional[str] = None


def config_fingerprint(cfg: DictConfig) -> tuple[dict[str, Any], str]:
    """The resolved config and its fingerprint as `run` computes it (a tune result is for it)."""
    from batchinfer.config.fingerprint import fingerprint, fingerprint_keys
    from batchinfer.rundir.prepare import resolve_config

    c, record = resolve_config(cfg)
    return c, fingerprint(fingerprint_keys(c, record["fingerprint"]))


def draw(cfg: DictConfig, folder: Path, rows: int, seed: int) -> tuple[Prompts, list[int]]:
    """Read the corpus as `validate` does, draw the pilot, write it as folder/pilot.parquet."""
    from batchinfer.inputs.convert import convert_input, open_input
    from batchinfer.models.tokens import LoginTokenizer, model_dir
    from batchinfer.rundir.prepare import resolve_input

    plain, files = resolve_input(cfg)
    inp = to_config(plain).input
    tok = LoginTokenizer.from_model_dir(model_dir(plain["model"]["path"], plain["model"]["revision"]))
    with tempfile.TemporaryDirectory(prefix="batchinfer-tune-") as tmp:
        dest = Path(tmp) / "input"
        convert_input(files, inp.format, dest, inp.id_column, inp.columns, strict_ids=False)
        ds = open_input(dest)
        prompts = read_prompts(to_config(plain), ds, tok)
        pilot = draw_pilot(prompts.keys, prompts.lengths, rows, seed)
        write_rows(ds, pilot, folder / "pilot.parquet")
        del ds  # memory-mapped from tmp
    return prompts, pilot


def write_rungs(folder: Path, pilot: int, n_rungs: int) -> list[str]:
    """Disjoint slices of the pilot, doubling in size: rungs/rung-R.parquet."""
    import pyarrow.parquet as pq

    table = pq.read_table(folder / "pilot.parquet")
    paths, start = [], 0
    for r, size in enumerate(rung_sizes(pilot, n_rungs)):
        path = folder / "rungs" / f"rung-{r}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table.slice(start, size), path)
        paths.append(str(path.resolve()))
        start += size
    return paths


def grid(c: Any, opts: Options) -> list[Setting]:
    """--try settings as given, else the default grid for this machine."""
    from batchinfer.config.engines import task_gpus

    include = parse_include(opts.include)
    if opts.tries:
        return parse_tries(opts.tries) + [s for s in default_grid(c, 0, [], include) if s.changes_outputs]
    return default_grid(c, len(task_gpus(c)), sorted(os.sched_getaffinity(0)), include)


def pooled_lengths(outcomes: list[Outcome]) -> tuple[list[int], int]:
    """Every pilot row's output tokens (outputs do not depend on the knobs: any setting's rung will
    do, one per rung) and how many stopped at max_tokens."""
    lengths: list[int] = []
    at_max = 0
    seen: set[int] = set()
    for o in outcomes:
        if o.setting.changes_outputs:
            continue
        for r in o.rungs:
            if r.rung not in seen:
                seen.add(r.rung)
                lengths += r.output_lengths
                at_max += r.stopped_at_max_tokens
    return lengths, at_max


def layout(c: Any, rows: int) -> Layout:
    """Array tasks, engines and devices of the full run, as plan and submit count them."""
    from batchinfer.config.engines import engines_per_task, gpus_per_engine, task_gpus
    from batchinfer.inputs.shards import plan_shards

    sh = c.sharding
    shards = plan_shards(rows, sh.num_shards, sh.rows_per_shard, DEFAULT_ROWS_PER_SHARD)
    gpus = int(c.cluster.gpus_per_task or 0) or len(task_gpus(c))
    return Layout(
        rows=rows,
        array_tasks=math.ceil(len(shards) / c.cluster.shards_per_task),
        engines_per_task=engines_per_task(c, gpus),
        devices_per_engine=gpus_per_engine(c) if gpus else 1,
        array_parallelism=c.cluster.array_parallelism,
    )


def with_overrides(c: Any, overrides: Sequence[str]) -> Any:
    """The config c with overrides applied as the command line applies them (the winner's settings:
    its cluster.engines_per_task lays out the forecast run)."""
    from batchinfer.config.compose import apply_overrides
    from batchinfer.config.schema import structured, to_config

    cfg = structured(asdict(c))
    apply_overrides(cfg, list(overrides))
    return to_config(cfg)


def prompt_tokens(prompts: Prompts, winner: Outcome) -> dict[str, float]:
    """The corpus's prompt tokens: every row counted as plan counts them, or (past EXACT_ROWS rows,
    where lengths are characters) the pilot's engine-counted tokens per row times the rows."""
    if prompts.unit == "tokens":
        total = float(sum(prompts.lengths))
    else:
        rows = sum(r.rows for r in winner.rungs)
        total = sum(r.prompt_tokens for r in winner.rungs) / rows * len(prompts.keys) if rows else 0.0
    return {"value": round(total), "low": round(total), "high": round(total)}


def default_folder(input_path: str, fp: str) -> Path:
    """runs/tune-<input stem>-<fingerprint[:8]>: where tune writes without --out, and where submit
    looks for a tune result of its config (tune/expected.py)."""
    return Path("runs") / f"tune-{Path(input_path).stem}-{fp[:8]}"


def tune_folder(cfg: DictConfig, opts: Options) -> tuple[Any, str, Path]:
    """The options checked; the resolved config, its fingerprint and the tune folder (not made)."""
    if opts.rows < MIN_PILOT_ROWS:
        raise ConfigError(f"--rows {opts.rows}: a pilot needs at least {MIN_PILOT_ROWS} rows")
    if opts.minutes <= 0:
        raise ConfigError(f"--minutes {opts.minutes}: must be positive")
    plain, fp = config_fingerprint(cfg)
    c = to_config(plain)
    if c.input.format == "openai":
        raise ConfigError(
            "input.format=openai: tune does not take OpenAI Batch files yet; tune on a JSONL of the texts"
        )
    return c, fp, Path(opts.out or default_folder(c.input.path, fp)).resolve()


def _older_tune(path: Path) -> Optional[ownership.Kind]:
    """A tune folder an older batchinfer made (no mark): nothing in it but names a tune makes, and
    either a finished tune's whole layout (tune.json of its shape, tune.md, pilot.parquet, rungs/,
    trials/) or a tune job's job.json. A folder that merely holds a file of such a name is the
    user's: a tune run again in an older one writes over its files."""

    def record(name: str) -> Any:
        try:
            return json.loads((path / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    if TUNE_LAYOUT.strays(path):
        return None
    result, job = record("tune.json"), record("job.json")
    finished = isinstance(result, dict) and {"version", "fingerprint", "settings", "best"} <= set(result)
    finished = finished and re.fullmatch(r"[0-9a-f]{64}", str(result.get("fingerprint"))) is not None
    finished = finished and all((path / name).exists() for name in _OLDER_TUNE_MADE)
    submitted = isinstance(job, dict) and str(job.get("name", "")).startswith("bi-tune-")
    return ownership.Kind.DONE if finished or submitted else None


@contextlib.contextmanager
def owned_folder(folder: Path, opts: Options) -> Iterator[Path]:
    """The tune folder, this tune's alone while it runs (ownership.py): a folder of the user's or of
    another command is refused, never written into; a tune running in it is refused naming it; one
    a killed tune left half made is cleared; a finished tune's is tuned again."""
    label = "tune --out" if opts.out else "the tune folder"
    with ownership.claim(folder, TUNE, layout=TUNE_LAYOUT, legacy=_older_tune, label=label) as own:
        mark = own.found.mark
        if own.existing and mark is not None and mark.command != TUNE:
            raise FolderRefused(
                f"{label} {folder} is a folder batchinfer {mark.command} made, not a tune folder; choose another --out"
            )
        if own.adopted and mark is not None:
            own.clear()
        yield folder


def fresh_trials(folder: Path) -> Path:
    """This tune's own trial folder, TUNE/trials/<time>-<pid>-<random>: a later tune never reopens
    a trial's run directories (their rates and rows are this tune's), even one in the same second."""
    parent = folder / "trials"
    ownership.make_dirs(parent, within=folder)  # a symlink planted at TUNE/trials is refused
    # mkdtemp creates an absent name atomically: two tunes in one second (one process) differ.
    return Path(tempfile.mkdtemp(prefix=f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-", dir=parent))


def tune(cfg: DictConfig, opts: Options) -> dict[str, Any]:
    """Run the whole tune and write its folder; the result as tune.json holds it."""
    c, fp, folder = tune_folder(cfg, opts)
    # output.private covers the tune folder as it covers a run directory: the pilot and rungs are
    # the user's input rows, the trials' spec.json their config
    with security.private_umask(c.output.private), owned_folder(folder, opts):
        security.make_private(folder, c.output.private)
        return _tune(cfg, opts, c, fp, folder)


def _tune(cfg: DictConfig, opts: Options, c: Any, fp: str, folder: Path) -> dict[str, Any]:
    from batchinfer.insight.cost import hourly_price

    price, price_source = hourly_price(opts.price, None)
    trials = fresh_trials(folder)
    settings = grid(c, opts)
    log.info("tune: drawing a %d-row pilot from %s", opts.rows, c.input.path)
    prompts, pilot = draw(cfg, folder, opts.rows, opts.seed)
    n_rungs = rungs_for(len(settings))
    rung_paths = write_rungs(folder, len(pilot), n_rungs)
    config_dir = str(Path(opts.config_dir).resolve()) if opts.config_dir else None

    counter = itertools.count()  # a setting repeated on a fresh engine gets a trial folder of its own

    def launch(s: Setting) -> TrialProcess:
        trial = trials / f"{next(counter):02d}"
        spec = {"overrides": [*opts.overrides, *s.overrides], "config_dir": config_dir, "rungs": rung_paths}
        return TrialProcess(s, dict(spec, out=str(trial / "runs")), trial)

    log.info("tune: %d settings, %d rungs of %s rows", len(settings), n_rungs, rung_sizes(len(pilot), n_rungs))
    outcomes = halve(settings, n_rungs, launch, opts.minutes * 60, say=log.info)
    return finish(c, opts, folder, fp, prompts, pilot, outcomes, (price, price_source))


def finish(
    c: Any,
    opts: Options,
    folder: Path,
    fp: str,
    prompts: Prompts,
    pilot: list[int],
    outcomes: list[Outcome],
    price: tuple[Optional[float], Optional[str]],
) -> dict[str, Any]:
    """Winner, distribution, forecast; tune.md, tune.png, conf/tuned/best.yaml and tune.json."""
    from batchinfer.tune.estimate import estimate, record

    choice = choose(outcomes)
    winner = choice.winner
    tune_noise = noise(outcomes)
    records = [results.setting_record(o) for o in outcomes]
    lengths, at_max = pooled_lengths(outcomes)
    best_overrides = winner.setting.override_strings() if winner else []
    group = results.write_group(folder, best_overrides) if winner else None
    fc = est = None
    run_config = with_overrides(c, winner.setting.overrides) if winner else c
    shape = layout(run_config, len(prompts.keys))
    # every corpus row ran once in the pilot's disjoint rungs: its output tokens are measured, not forecast
    whole = len(set(pilot)) == len(prompts.keys) == len(lengths) > 0
    if winner is not None and winner.startup_seconds is not None:
        generates = c.task.name not in POOLING_TASKS
        # the forecast counts engines (forecast.point): it takes one engine's rate, not the task's
        rate = winner.per_engine("output_tokens" if generates else "rows")
        est = estimate(winner, prompts, run_config, shape.engines_per_task, lengths, tune_noise, opts.seed)
        measured = Measured(
            lengths or [0], rate or 0.0, winner.startup_seconds, generates, est.model, est.speed_sd, whole
        )
        fc = {
            "prompt_tokens": prompt_tokens(prompts, winner),
            **as_json(forecast(shape, measured, price[0], opts.seed)),
        }
    pilot_lengths = [prompts.lengths[i] for i in pilot]
    result = {
        "version": TUNE_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "fingerprint": fp,
        "overrides": opts.overrides,
        "config_dir": opts.config_dir,
        "folder": str(folder),
        "sample": {
            "input": c.input.path,
            "rows": len(prompts.keys),
            "pilot_rows": len(pilot),
            "pilot_is_corpus": whole,
            "seed": opts.seed,
            "length_unit": prompts.unit,
            "corpus_length_p10_p50_p90": quantiles(prompts.lengths),
            "pilot_length_p10_p50_p90": quantiles(pilot_lengths),
            "corpus_duplicate_share": round(duplicate_share(prompts.keys), 4),
            "pilot_duplicate_share": round(duplicate_share([prompts.keys[i] for i in pilot]), 4),
            "prompt_tokens": sum(prompts.lengths) if prompts.unit == "tokens" else None,
        },
        "settings": records,
        "choice": {
            "reason": choice.reason,
            "fastest_measured": choice.leader.setting.name if choice.leader else None,
            "noise": round(tune_noise, 4) if tune_noise is not None else None,
        },
        "best": {
            "name": winner.setting.name if winner else None,
            "overrides": best_overrides,
            "config_group": str(group) if group else None,
            "use": f"--config-dir {folder / 'conf'} +{results.GROUP}={results.OPTION}" if group else None,
        },
        "output_lengths": output_distribution(lengths, at_max),
        "layout": shape.__dict__,
        "price": {"usd_per_gpu_hour": price[0], "source": price[1]},
        "forecast": fc,
        "forecast_model": record(est) if est is not None else None,
    }
    write_record(folder / "tune.md", redact_text(results.format_result(result)) + "\n")
    results.plot(records, result["best"]["name"], folder / "tune.png")
    results.write_json(folder, result)
    return result
