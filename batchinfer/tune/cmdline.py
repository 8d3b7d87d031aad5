"""The `tune` subcommand's options and what it prints (the CLI module only wires them in)."""

from __future__ import annotations

import argparse
from typing import Any

from batchinfer.redaction import record_json


def add_options(p: argparse.ArgumentParser) -> None:
    """--rows, --minutes, --seed, --include, --try, --gpu-hour-price, --out, --json, --wait."""
    p.add_argument("--rows", type=int, default=256, help="pilot rows drawn from the input (default 256)")
    p.add_argument("--minutes", type=float, default=30.0, help="time budget of all trials (default 30)")
    p.add_argument("--seed", type=int, default=0, help="seed of the pilot draw and the bootstrap (default 0)")
    p.add_argument(
        "--include", metavar="fp8,kv-fp8,ngram", help="also try settings that change outputs (marked, never chosen)"
    )
    p.add_argument(
        "--try",
        dest="tries",
        action="append",
        default=[],
        metavar="'k=v k=v'",
        help="a setting to try instead of the default grid (repeatable; `defaults`; env.NAME=V sets the "
        "engine's environment)",
    )
    p.add_argument("--gpu-hour-price", type=float, metavar="USD", help="price of one GPU-hour, for the cost forecast")
    p.add_argument("--out", metavar="DIR", help="the tune folder (default runs/tune-<input stem>-<fingerprint[:8]>)")
    p.add_argument("--json", action="store_true", help="print the result as JSON (also in DIR/tune.json)")
    p.add_argument(
        "--wait",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with cluster=slurm: wait for the tune job and print its table (default); --no-wait returns at once",
    )


def run(args: argparse.Namespace, cfg: Any) -> int:
    """Tune with the composed config (here, or as one Slurm job with cluster=slurm); print the table
    (or JSON); 1 when no setting finished."""
    from batchinfer.tune.command import Options, tune
    from batchinfer.tune.results import format_result

    opts = Options(
        overrides=list(args.overrides),
        config_dir=args.config_dir,
        rows=args.rows,
        minutes=args.minutes,
        seed=args.seed,
        include=args.include,
        tries=args.tries,
        price=args.gpu_hour_price,
        out=args.out,
    )
    if cfg.cluster.name == "slurm":  # the whole tune as one job on the target partition
        from batchinfer.tune.remote import run as run_on_slurm

        return run_on_slurm(cfg, opts, follow=args.wait, as_json=args.json)
    result = tune(cfg, opts)
    print(record_json(result, indent=2) if args.json else format_result(result))
    if not args.json:
        print(f"written: {result['folder']}/ (tune.md, tune.png, tune.json, conf/)")
    return 0 if result["best"]["name"] is not None else 1
