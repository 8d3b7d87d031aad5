"""`batchinfer redo DIR --where EXPR [overrides]`: a pass over the rows of DIR's merged output that
match EXPR, with the overrides on top of DIR's config, in DIR/passes/N/ (a run directory of its
own), run here or as a Slurm array; merge then puts its answers in place in DIR's output."""

from __future__ import annotations

import logging
import shlex
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from batchinfer import faults, ownership
from batchinfer.config.schema import DEFAULT_ROWS_PER_SHARD, structured
from batchinfer.config.store import conf_dir
from batchinfer.errors import ConfigError, RunDirError
from batchinfer.ownership import Kind
from batchinfer.redaction import strike_overrides
from batchinfer.rundir import image_files, passes
from batchinfer.rundir.merge import format_indices, incomplete_shards, merge
from batchinfer.rundir.prepare import prepare
from batchinfer.rundir.splice import select_rows, view_schema, write_selection
from batchinfer.rundir.store import RunDir
from batchinfer.rundir.where import compile_where
from batchinfer.security import private_umask, refuse_secret_in

log = logging.getLogger("batchinfer")

# Keys a pass sets itself: its input is the selected rows, its folder DIR/passes/N, its parts Parquet.
OWN_KEYS = ("input.", "output.dir", "output.format", "output.max_rows_per_file")


def redo(
    root_dir: str, where: str, overrides: list[str], config_dir: Optional[str] = None, engine: Any = None
) -> RunDir:
    """Make (or reopen) the pass of this where and these overrides, run it (on engine, when given:
    tests share one), merge DIR."""
    root = RunDir(root_dir)
    root.run  # noqa: B018  (refuses a folder without run.yaml)
    if passes.is_pass(root):
        raise RunDirError(f"{root.path} is a pass of {passes.root_of(root).path}: redo selects from that one")
    compile_where(where, view_schema(root))  # a bad expression is refused before anything
    # pass.json keeps the --where as typed (a resume and the same redo run it): no secret in it (K5)
    strike_overrides(list(overrides))  # a secret typed in these overrides counts too
    refuse_secret_in("--where", where, record="the pass's pass.json keeps it as typed")
    for ov in overrides:
        if ov.lstrip("+~").startswith(OWN_KEYS):
            raise ConfigError(f"{ov}: a pass sets {ov.split('=')[0]} itself (its input is the selected rows)")
    # One redo (or resume of a pass) of DIR at a time, from the check through the selection to the
    # pass's prepare, and while it runs here: a pass made meanwhile cannot go unseen by a selection,
    # and a second redo is refused naming the first instead of taking its pass.
    with holding(root, "redo"):
        missing = incomplete_shards(root)
        if missing:
            raise RunDirError(
                f"{root.path}: shards {format_indices(missing)} are not finished; redo selects from a finished "
                f"run: `batchinfer resume {shlex.quote(str(root.path))}` (or the same `batchinfer run`) first"
            )
        run = _open_pass(root, where, overrides, config_dir)
        if run is None:
            return root
        return run_pass(run, engine)


def holding(root: RunDir, command: str) -> AbstractContextManager[Any]:
    """DIR's lock (ownership.hold) for a command that makes or runs one of its passes."""
    return ownership.hold(root.path, command, mode=root.config.output.lock)


def _open_pass(root: RunDir, where: str, overrides: list[str], config_dir: Optional[str]) -> Optional[RunDir]:
    """The unfinished pass of this command (made by a redo that was stopped), or a new one (taking
    over a pass whose redo was stopped while making it)."""
    number = passes.unfinished_pass(root)
    if number is None:
        numbers = passes.pass_numbers(root)
        if numbers and not passes.output_is_current(root):  # stopped between the pass's merge and DIR's
            merge(root)
            if passes.read_record(passes.pass_path(root, numbers[-1])).same_command(where, overrides, config_dir):
                print(f"pass {numbers[-1]} of {root.path} was finished: merged into {root.output_path}")
                return None
        return new_pass(root, where, overrides, config_dir)
    path = passes.pass_path(root, number)
    found = passes.recognise(path)
    if found.kind is Kind.HALF_MADE:  # its redo was stopped while making it: nothing of it ran
        return new_pass(root, where, overrides, config_dir, number)
    if found.kind is not Kind.DONE:
        raise passes.being_made(root, number, found)
    rec = passes.read_record(path)
    if not rec.same_command(where, overrides, config_dir):
        raise RunDirError(
            f"{path} ({rec.describe()}) is not finished; finish it first with the same command or "
            f"`batchinfer resume {shlex.quote(str(root.path))}` (or remove {path} to drop it)"
        )
    print(f"resuming pass {number} of {root.path}: {rec.describe()}")
    return prepare(pass_config(root, path, overrides, config_dir))  # reopens: the same overrides, the same fingerprint


def new_pass(
    root: RunDir, where: str, overrides: list[str], config_dir: Optional[str] = None, number: Optional[int] = None
) -> Optional[RunDir]:
    """Select the rows, then make DIR/passes/N (the next number, or a half-made pass to take over)
    through ownership.claim: pass.json, selection.parquet, prepared; None if no row matches."""
    rows = select_rows(root, compile_where(where, view_schema(root)))
    if not len(rows):
        print(f"no row of {root.path} matches {where!r}: nothing to redo")
        return None
    # a changed image file that rows this redo keeps name would mix old answers with new ones
    image_files.refuse_changed_images(root.path, redone=rows.tolist())
    number = number or max(passes.pass_numbers(root), default=0) + 1
    path = passes.pass_path(root, number)
    private = root.config.output.private
    with (
        private_umask(private),
        ownership.claim(
            path,
            "redo",
            layout=passes.LAYOUT,
            mode=root.config.output.lock,
            legacy=passes.legacy_kind,
            label=f"pass {number} of",
            within=root.path,  # a symlink planted at DIR/passes is refused, never followed
        ) as made,
    ):  # what is made here is removed if this raises, and only that
        faults.point(faults.PASS_FOLDER_MADE)
        if made.existing:  # made and finished by someone, yet no pass.json: not ours to fill
            raise RunDirError(f"{path} is there without {passes.PASS_JSON}; move it away to make pass {number}")
        if made.adopted:
            print(f"pass {number} of {root.path} was left half made by a redo that was stopped: made again")
            made.clear()
        passes.write_record(path, number, where, overrides, config_dir)
        write_selection(root, rows, path)
        passes.set_rows(path, len(rows))
        run = prepare(pass_config(root, path, overrides, config_dir))
        passes.check_schema(root, run)
    print(f"pass {number} of {root.path}: {len(rows)} rows match {where!r}; in {path}")
    return run


def pass_config(root: RunDir, path: Path, overrides: list[str], config_dir: Optional[str]) -> DictConfig:
    """DIR's config with the overrides on top, reading the selected rows into DIR/passes/N."""
    from batchinfer.config.checks import validate
    from batchinfer.config.compose import apply_overrides, compose

    c = root.run["config"]
    cfg = structured(c)
    groups = {d.name for d in conf_dir().iterdir() if d.is_dir() and not d.name.startswith("_")}
    chosen = [ov for ov in overrides if ov.partition("=")[0] in groups]
    if chosen:  # a preset replaces its whole group, as on the run command line
        fresh = compose(chosen, config_dir=config_dir)
        for ov in chosen:
            group = ov.partition("=")[0]
            OmegaConf.update(cfg, group, fresh[group], merge=False)
    cfg.input.path = str(path / passes.SELECTION)
    cfg.input.format = "parquet"
    cfg.input.id_column = c["input"]["id_column"] or passes.SOURCE_ROW  # ids (and per-row seeds) kept
    cfg.output.dir = str(path)
    cfg.output.format = "parquet"
    cfg.output.max_rows_per_file = None
    cfg.sharding.num_shards = None
    cfg.sharding.rows_per_shard = c["sharding"]["rows_per_shard"] or _rows_per_shard(root)
    keys = [ov for ov in overrides if ov not in chosen]
    apply_overrides(cfg, keys)
    cfg.input.sampling_overridden = passes.overridden_sampling(c, keys)
    if any(ov.startswith("sharding.num_shards=") for ov in keys):
        cfg.sharding.rows_per_shard = None
    validate(cfg)
    return cfg


def _rows_per_shard(root: RunDir) -> int:
    """DIR's shard size (its first shard's rows): a pass's shards are as long."""
    shards = root.shards()
    return max(shards[0].rows, 1) if shards else DEFAULT_ROWS_PER_SHARD


def run_pass(run: RunDir, engine: Any = None) -> RunDir:
    """Run a pass here, or submit it as a Slurm array (cluster=slurm); its merge merges DIR."""
    todo = incomplete_shards(run)
    if run.config.cluster.name == "slurm":
        from batchinfer.launch.submit import refuse_active_jobs, submit_shards

        if todo:
            advice = f"wait for them (`batchinfer status {shlex.quote(str(passes.root_of(run).path))}`) or cancel them"
            refuse_active_jobs(run, advice)  # a second array and merge job would run beside them
            submit_shards(run, todo)
            return run
    elif todo:
        from batchinfer.launch.local import run_shards

        run_shards(run, todo, engine)
    merge(run)
    root = passes.root_of(run)
    image_files.image_changes(root.path)  # the redone rows' answers from new image bytes are merged: recorded
    print(f"done: {root.output_path} (pass {run.path.name} merged)")
    return run


def resume_pass(root_dir: str, overrides: list[str], force: bool = False, dry_run: bool = False) -> bool:
    """`resume DIR` when DIR's own shards are done and a pass is not: finish that pass (submitted
    again under cluster=slurm, else here) and merge; merge DIR when a finished pass is not in its
    output; False when DIR has no such pass."""
    from batchinfer.launch.submit import resume

    root = RunDir(root_dir)
    if not root.exists() or passes.is_pass(root) or incomplete_shards(root):
        return False
    number = passes.unfinished_pass(root)
    if number is None:
        return _merge_passes(root, dry_run)
    path = passes.pass_path(root, number)
    found = passes.recognise(path)
    if found.kind is Kind.HALF_MADE:  # only the redo command knows its rows: it takes the pass over
        rec = passes.read_record(path)
        raise RunDirError(
            f"pass {number} of {root.path} was stopped while it was being made; run the same command again: "
            f"`batchinfer redo {shlex.quote(str(root.path))} {' '.join(shlex.quote(a) for a in rec.describe_args())}`"
        )
    if found.kind is not Kind.DONE:
        raise passes.being_made(root, number, found)
    run = RunDir(path)
    print(f"pass {number} of {root.path} ({passes.read_record(path).describe()}) is not finished: resuming it")
    if dry_run and run.config.cluster.name != "slurm":
        todo = incomplete_shards(run)
        print(f"dry run: shards {format_indices(todo)} of {path} would run here, then merge; nothing started")
        return True
    with holding(root, "resume"):  # not beside a redo of DIR submitting or running this pass
        if run.config.cluster.name == "slurm":
            resume(str(path), overrides, force=force, dry_run=dry_run)
        else:
            run_pass(run)
    return True


def _merge_passes(root: RunDir, dry_run: bool) -> bool:
    """resume DIR whose passes are finished but not all in its output (a kill between a pass's
    merge and DIR's; DIR's merge lock refused a pass's merge job): merge DIR."""
    if not passes.pass_numbers(root) or passes.output_is_current(root):
        return False
    if dry_run:
        print(f"dry run: {root.output_path} does not hold every finished pass; resume would merge {root.path}")
        return True
    stats = merge(root)
    print(f"merged {stats['rows']} rows into {root.output_path} (every finished pass)")
    return True


def cancel_passes(root_dir: str) -> None:
    """`cancel DIR`: the jobs of DIR's passes too."""
    from batchinfer.launch.submit import cancel

    root = RunDir(root_dir)
    for number in passes.pass_numbers(root):
        path = passes.pass_path(root, number)
        if (path / "jobs.jsonl").is_file():
            cancel(str(path))
