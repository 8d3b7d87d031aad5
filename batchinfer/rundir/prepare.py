"""Config -> plan: resolve the config, fingerprint it, create or reopen the run directory."""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa
from omegaconf import DictConfig

from batchinfer import __version__, ownership
from batchinfer.config.checks import check_output_format, check_sampling_column
from batchinfer.config.compose import require_run_keys
from batchinfer.config.fingerprint import (
    config_files,
    describe_change,
    fingerprint,
    fingerprint_keys,
    key_changes,
    legacy_fingerprint,
    read_config_files,
)
from batchinfer.config.schema import DEFAULT_ROWS_PER_SHARD, POOLING_TASKS, Config, InputConfig, to_config, to_dict
from batchinfer.durable import atomic_write, write_json
from batchinfer.errors import ConfigError, FolderRefused, RunDirError
from batchinfer.inputs.columns import column_type
from batchinfer.inputs.convert import convert_input, open_input
from batchinfer.inputs.fingerprint import FingerprintJob, file_fingerprint
from batchinfer.inputs.formats import detect_format
from batchinfer.inputs.openai_batch import ROW_SAMPLING
from batchinfer.inputs.paths import GLOB_CHARS, input_files, looks_like_hub_dataset
from batchinfer.inputs.reference import is_reference
from batchinfer.inputs.shards import plan_shards
from batchinfer.locks import flock_works
from batchinfer.logs import plural
from batchinfer.models.identity import IdentityRecord, ModelIdentity, recorded_identity
from batchinfer.models.locations import resolve_model
from batchinfer.models.lora import pinned_adapters
from batchinfer.models.pooling import embedding_dim
from batchinfer.models.tokens import model_dir
from batchinfer.redaction import exact
from batchinfer.requests.prompts import apply_labels, messages_note
from batchinfer.requests.row_templates import check_row_templates
from batchinfer.rundir import image_files
from batchinfer.rundir.model_record import KEY as MODEL_IDENTITY
from batchinfer.rundir.model_record import identity_of, refuse_changed_model
from batchinfer.rundir.reuse import checked_reuse
from batchinfer.rundir.schema import output_schema, pooling_schema, schema_summary, schema_to_text
from batchinfer.rundir.store import EXACT_RECORD, FILES_DIR, PREPARE_LAYOUT, PREPARING, InputRecord, RunDir
from batchinfer.security import (
    check_secret_values,
    exposure_warning,
    keep_restriction,
    make_private,
    private_umask,
    remove_path,
)
from batchinfer.versions import installed_versions

log = logging.getLogger("batchinfer")


def resolve_config(cfg: DictConfig) -> tuple[dict[str, Any], InputRecord]:
    """Plain config with the input resolved, and the input's fingerprint record."""
    c, files = resolve_input(cfg)
    return c, file_fingerprint(files, _previous_input(c), c["input"]["format"])


def _previous_input(c: dict[str, Any]) -> Optional[InputRecord]:
    """The input record of the run directory output.dir names, if there is one."""
    if c["output"]["dir"] and RunDir(c["output"]["dir"]).exists():
        return RunDir(c["output"]["dir"]).run["input"]
    return None


def resolve_input(cfg: DictConfig, input_required: bool = True) -> tuple[dict[str, Any], list[Path]]:
    """Plain config with input path, format, labels and model resolved, and the input files (none
    when input.path is unset and not required: `plan` sizes a model alone)."""
    require_run_keys(cfg, input_required)
    c = to_dict(cfg)
    apply_labels(c)
    c["model"]["path"], c["model"]["revision"] = resolve_model(c["model"]["path"], c["model"]["revision"])
    lora = c["model"]["lora"]
    lora["adapters"] = pinned_adapters(lora["adapters"])  # hub names: their snapshot folders
    if not c["input"]["path"]:
        return c, []
    files = input_files(c["input"]["path"], c["input"]["split"])
    if looks_like_hub_dataset(c["input"]["path"]):
        pass  # the name stays: the files' snapshot folder records the revision in the fingerprint
    elif GLOB_CHARS & set(c["input"]["path"]):
        c["input"]["path"] = str(Path(c["input"]["path"]).expanduser().absolute())
    else:
        c["input"]["path"] = str(files[0])
    c["input"]["format"] = detect_format(files, c["input"]["format"])
    if c["input"]["format"] == "openai":  # custom_id is the id; answers follow the Batch output format
        c["input"]["id_column"] = c["input"]["id_column"] or "custom_id"
        c["output"]["format"] = "openai"
        task = (c.get("task") or {}).get("name", "generate")
        check_output_format(task, "openai", "openai", source=c["input"]["path"])
    return c, files


def check_writable(path: Path) -> None:
    """Create and remove a file in path, or in its nearest existing parent; ConfigError naming the reason.
    os.access cannot tell: it says yes to root whatever the mode bits."""
    where = Path(os.path.abspath(path))
    if where.is_symlink() or (where.exists() and not where.is_dir()):
        return  # not a folder: ownership.claim refuses it, naming what it is
    if where.is_dir() and ownership.recognise(where).kind is ownership.Kind.FOREIGN:
        return  # not empty and not ours: nothing is written into it, not even a probe
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        fd, name = tempfile.mkstemp(prefix=".batchinfer-write-test-", dir=where)
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        raise ConfigError(
            f"output.dir {path}: not writable ({e.strerror}: {where}); choose a writable output.dir"
        ) from None


def run_dir_for(c: dict[str, Any], fp: str) -> RunDir:
    """output.dir, or runs/<input-stem>-<fingerprint[:8]> under the current folder."""
    if c["output"]["dir"]:
        return RunDir(c["output"]["dir"])
    stem = Path(c["input"]["path"]).name.split(".")[0]
    return RunDir(Path("runs") / f"{stem}-{fp[:8]}")


def prepare(cfg: DictConfig) -> RunDir:
    """Create the run directory (input converted once, plan, schema) or reopen it if unchanged."""
    with private_umask(cfg.output.private):
        run = _prepare(cfg)
        make_private(run.path, cfg.output.private)
    return run


def _prepare(cfg: DictConfig) -> RunDir:
    c, files = resolve_input(cfg)
    # as run.yaml will hold it, paths resolved: a relative input.path under a folder named with a
    # secret's value was checked as typed only (attack42b K9); refused before a folder is made
    check_secret_values(c)
    contents = read_config_files(c)  # read once: the fingerprint and the frozen copies share these bytes
    # The input is hashed in a thread: where output.dir names a folder to make, beside the conversion
    # (which does not need the hash); where the hash names the folder or is compared, before.
    with FingerprintJob(files, _previous_input(c), c["input"]["format"]) as job:
        keyed = copy.deepcopy(c)

        def identify() -> _Identity:
            record = job.result()
            keys = fingerprint_keys(keyed, record["fingerprint"], contents)
            return _Identity(record, keys, fingerprint(keys))

        if c["output"]["dir"]:
            run = RunDir(c["output"]["dir"])
        else:
            ident = identify()
            run = run_dir_for(c, ident.fp)
            if not run.exists():
                legacy = run_dir_for(c, legacy_fingerprint(ident.keys))  # a default DIR named by an older version
                if legacy.exists():
                    run = legacy
        model = c["model"]
        identity = identity_of(model["path"], model["revision"], model["lora"]["adapters"], model["identity"])
        c["output"]["reuse"] = checked_reuse(c["output"]["reuse"], run, identity.digest)  # not in the fingerprint
        check_writable(run.path)
        # One prepare of a folder at a time, and only of a folder it made (ownership.py): a second
        # prepare is refused naming the first, and a failure removes only what this one made.
        with ownership.claim(
            run.path,
            PREPARE,
            layout=PREPARE_LAYOUT,
            mode=c["output"]["lock"],
            legacy=_made_by_older,
            label="output.dir",
        ) as own:
            if own.existing:
                return _reopen(run, c, identify().keys, own.found, identity)
            if own.adopted and own.found.mark is not None:
                own.clear()  # a prepare killed half way: its contents, never anyone else's
            _create(run, c, identify, contents, identity.to_dict())
    return run


@dataclass(frozen=True)
class _Identity:
    """What identifies a run's outputs: the input's fingerprint record, the fingerprint keys, their hash."""

    input_record: InputRecord
    keys: dict[str, Any]
    fp: str


PREPARE = "prepare"


def _made_by_older(path: Path) -> Optional[ownership.Kind]:
    """What an unmarked folder an older batchinfer made is: a run directory, or one half made (its
    PREPARING file there, and only names an older prepare made beside it: ownership.recognise
    takes any other name for the user's, the folder for FOREIGN)."""
    if (path / "run.yaml").is_file():
        return ownership.Kind.DONE
    return ownership.Kind.HALF_MADE if (path / PREPARING).exists() else None


def _reopen(
    run: RunDir, c: dict[str, Any], keys: dict[str, Any], found: ownership.Found, identity: ModelIdentity
) -> RunDir:
    """An existing run directory, unchanged in what makes its outputs (other settings are updated)."""
    if not run.exists():
        made = f"batchinfer {found.mark.command}" if found.mark else "batchinfer"
        raise FolderRefused(f"output.dir {run.path} is a folder {made} made, not a run directory; choose another")
    old = run.run
    # run.yaml holds them exactly but a secret-named key's value (struck on both sides)
    changes = key_changes(exact(old["fingerprint_keys"]), exact(keys))
    if changes:
        shown = ", ".join(describe_change(*change) for change in changes)
        maker = f" (made by {found.mark.describe()})" if found.mark else ""
        raise RunDirError(
            f"{run.path}{maker} was made with a different config: {shown}. These change outputs, so the "
            f"run cannot continue in this directory; use another output.dir or restore the old values"
        )
    recorded = recorded_identity(old.get(MODEL_IDENTITY))
    if recorded is not None and recorded.mode != identity.mode:  # checked as it was recorded
        model = c["model"]
        identity = identity_of(model["path"], model["revision"], model["lora"]["adapters"], recorded.mode)
    refuse_changed_model(run.path, old, identity, c["model"]["lora"]["adapters"])
    image_files.refuse_changed_images(run.path)
    c = freeze_paths(run, c)
    if old["config"] != c or old.get("redaction") != EXACT_RECORD:
        old["config"] = c  # only settings outside the fingerprint differ (commit intervals, cluster)
        old["redaction"] = EXACT_RECORD  # composed now: what the user typed, as it runs
        run.write_run(old)
    return run


def _pooling_schema(c: Config, id_type: pa.DataType, input_type: Any) -> pa.Schema:
    """A pooling task's output schema: the embedding size from the model (or task.dimensions)."""
    task = c.task
    dim = None
    if task.name == "embed":
        dim = task.dimensions or embedding_dim(model_dir(c.model.path, c.model.revision))
    return pooling_schema(task.name, id_type, input_type, dim)


def freeze_paths(run: RunDir, c: dict[str, Any]) -> dict[str, Any]:
    """c with each file key pointing at DIR's frozen copy of it (run.yaml `files`), so every task
    reads the bytes fingerprinted at prepare; a DIR made before files were frozen keeps c's paths."""
    frozen = (run.run.get("files") or {}) if run.exists() else {}
    return _with_paths(c, {key: str(run.path.absolute() / rec["path"]) for key, rec in frozen.items()})


def _with_paths(c: dict[str, Any], paths: dict[str, str]) -> dict[str, Any]:
    c = copy.deepcopy(c)
    if "prompt.template_file" in paths:
        c["prompt"]["template_file"] = paths["prompt.template_file"]
    if "sampling.structured_outputs.json" in paths:
        c["sampling"]["structured_outputs"]["json"] = paths["sampling.structured_outputs.json"]
    return c


def _freeze_files(run: RunDir, c: dict[str, Any], contents: dict[str, bytes]) -> dict[str, dict[str, str]]:
    """Copy the files the config names into DIR/files/<key>/<name>; their record for run.yaml."""
    record = {}
    for key, path in config_files(c).items():
        rel = Path(FILES_DIR) / key / (Path(path).name or "file")
        (run.path / rel).parent.mkdir(parents=True, exist_ok=True)
        atomic_write(run.path / rel, contents[key])
        record[key] = {
            "source": str(Path(path).expanduser().absolute()),
            "path": str(rel),
            "sha256": hashlib.sha256(contents[key]).hexdigest(),
        }
    return record


def _create(
    run: RunDir,
    c: dict[str, Any],
    identify: Callable[[], _Identity],
    contents: dict[str, bytes],
    identity: IdentityRecord,
) -> None:
    """Make the run directory: frozen files, DIR/input, plan, run.yaml. identify() gives the input's
    fingerprint, asked for once the input is converted (the hash runs meanwhile)."""
    files = _freeze_files(run, c, contents)
    c = _with_paths(c, {key: str(run.path.absolute() / rec["path"]) for key, rec in files.items()})
    config = to_config(c)
    inp = config.input
    rows = _convert(run, inp)
    _keep_restriction(run, inp)
    ds = open_input(run.input_dir)
    if is_reference(run.input_dir):
        log.info("%s refers to the %s files in place (not copied)", run.input_dir, inp.format)
    check_row_templates(config, ds.column_names, inp.path)
    check_sampling_column(inp.sampling_column, ds.column_names, inp.path)
    note = messages_note(config.prompt, ds.data)
    if note:
        log.warning("%s", note)
    schema = _run_schema(config, ds.data.schema)
    image_files.record_images(run.path, config, ds)
    ident = identify()
    input_record, keys, fp = ident.input_record, ident.keys, ident.fp
    sh = config.sharding
    shards = plan_shards(rows, sh.num_shards, sh.rows_per_shard, DEFAULT_ROWS_PER_SHARD)
    write_json(
        run.plan_json,
        {
            "rows": rows,
            "input_fingerprint": input_record["fingerprint"],
            "shards": [{"index": s.index, "start": s.start, "stop": s.stop, "rows": s.rows} for s in shards],
        },
    )

    run.write_run(
        {
            "batchinfer": __version__,
            "redaction": EXACT_RECORD,  # its config holds what runs (an older one's may hold struck text)
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "host": socket.gethostname(),
            "fingerprint": fp,
            "fingerprint_keys": keys,
            MODEL_IDENTITY: identity,  # what model.path held: request digests key on it
            "files": files,
            "input": dict(input_record, path=inp.path, format=inp.format, rows=rows),
            "output_schema": {"columns": schema_summary(schema), "arrow": schema_to_text(schema)},
            "versions": installed_versions(),
            "config": c,
        }
    )
    (run.path / PREPARING).unlink(missing_ok=True)  # an older prepare's, or an older redo's
    log.info("prepared %s: %s in %s", run.path, plural(rows, "row"), plural(len(shards), "shard"))


def _keep_restriction(run: RunDir, inp: InputConfig) -> None:
    """DIR/input as private as the input; its answers (shards, output) are not: say so, as status does."""
    kept = keep_restriction(run.input_dir, input_files(inp.path, inp.split))
    if kept:
        log.info("%s", kept)
        warning = exposure_warning(run.path, inp.path)
        if warning:
            log.warning("%s", warning)


def _convert(run: RunDir, inp: InputConfig) -> int:
    """Convert the input into DIR/input once; its row count."""
    remove_path(run.input_dir, ignore_errors=True)  # a symlinked DIR/input: the link goes, never its target
    log.info("reading %s (%s) into %s", inp.path, inp.format, run.input_dir)
    # `datasets` file-locks its cache: where flock fails (Lustre noflock, NFS without a lock
    # manager) its cache goes to a node-local temporary folder, removed after the conversion.
    local_cache = not flock_works(run.path)
    if local_cache:
        log.warning(
            "flock does not work in %s: converting the input with a cache in %s", run.path, tempfile.gettempdir()
        )
    return convert_input(
        input_files(inp.path, inp.split),
        inp.format,
        run.input_dir,
        inp.id_column,
        inp.columns,
        local_cache=local_cache,
    )


def _run_schema(c: Config, arrow: pa.Schema) -> pa.Schema:
    """The run's output schema, from the task and the converted input's schema (arrow)."""
    inp = c.input
    id_type = arrow.field(inp.id_column).type if inp.id_column else pa.int64()
    columns = inp.columns or []
    input_type = pa.struct([(col, column_type(arrow, col, inp.path)) for col in columns]) if columns else None
    if c.task.name in POOLING_TASKS:
        return _pooling_schema(c, id_type, input_type)
    # OpenAI batch rows may ask for n > 1 each: keep a samples column for them (and in a redo's
    # pass of such rows, whose input is the selected requests as Parquet).
    with_samples = c.sampling.n > 1 or ROW_SAMPLING in arrow.names
    labels = c.prompt.labels
    return output_schema(
        id_type,
        2 if with_samples else 1,
        input_type,
        reasoning=bool(c.model.reasoning_parser),
        labels=bool(labels.names),
        confidence=labels.confidence,
        adapter=bool(c.model.lora.adapters),
    )
