"""A run's model identity (models/identity.py): taken at prepare into run.yaml `model_identity`,
and checked against the model folder before rows are answered again (reopen, resume, each worker):
rows answered by other weights than the ones recorded would mix two models in one output.

A run directory prepared before identities were recorded has none: it resumes as before (nothing to
compare), and its answers are never reused by a run that records one (their request digests lack
it; the digests could only say the path was the same, not the weights)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Optional

from batchinfer.errors import RunDirError
from batchinfer.models.identity import SAMPLED, ModelIdentity, model_identity, recorded_identity
from batchinfer.models.lora import adapter_identities
from batchinfer.models.tokens import model_dir
from batchinfer.rundir.store import RunRecord

log = logging.getLogger("batchinfer")
KEY = "model_identity"  # run.yaml's key


def identity_of(
    path: str, revision: Optional[str], adapters: Optional[dict[str, str]] = None, mode: str = SAMPLED
) -> ModelIdentity:
    """The identity of model.path (a folder, or a hub name's snapshot in the local cache) now, with
    each LoRA adapter's files as `lora/NAME/FILE` (model.lora.adapters): a changed adapter is a
    changed model, named by its files. Large files are hashed as mode (model.identity) says."""
    base = model_identity(model_dir(path, revision), mode)
    if not adapters:
        return base
    files = list(base.files)
    for name, identity in adapter_identities(adapters, mode).items():
        files += [dataclasses.replace(f, name=f"{LORA_PREFIX}{name}/{f.name}") for f in identity.files]
    return ModelIdentity(folder=base.folder, files=tuple(sorted(files, key=lambda f: f.name)), mode=mode)


LORA_PREFIX = "lora/"  # an adapter's files in a model identity


def identity_digest(record: RunRecord) -> Optional[str]:
    """The recorded identity's digest of a run.yaml record (None: none recorded)."""
    identity = recorded_identity(record.get(KEY))
    return identity.digest if identity is not None else None


def model_changes(record: RunRecord, now: ModelIdentity) -> list[str]:
    """How the model folder now differs from what a run.yaml record holds (empty: same, or none recorded)."""
    old = recorded_identity(record.get(KEY))
    return old.changes(now) if old is not None else []


def refuse_changed_model(
    where: Any, record: RunRecord, now: ModelIdentity, adapters: Optional[dict[str, str]] = None
) -> None:
    """RunDirError naming the folders that changed (the model's, each changed LoRA adapter's as
    model.lora.adapters names it, and where a symlink leads) and their changed files."""
    changes = model_changes(record, now)
    if not changes:
        return
    named = sorted({c.split("/")[1] for c in changes if c.startswith(LORA_PREFIX)})
    folders = [f"the model folder {now.folder}"] if any(not c.startswith(LORA_PREFIX) for c in changes) else []
    folders += [_adapter_folder(name, (adapters or {}).get(name)) for name in named]
    shown = "; ".join(changes[:6]) + (f"; and {len(changes) - 6} more" if len(changes) > 6 else "")
    verb = "is" if len(folders) == 1 else "are"
    raise RunDirError(
        f"{where}: {' and '.join(folders)} {verb} not the one this run was prepared with ({shown}). "
        "Its rows so far are answers of the old weights: restore the folder, or start a new run "
        "(another output.dir; output.reuse of this one reuses none of its answers)"
    )


def _adapter_folder(name: str, path: Optional[str]) -> str:
    """`LoRA adapter NAME (model.lora.adapters.NAME=PATH, a symlink to TARGET)` for a refusal."""
    if path is None:
        return f"LoRA adapter {name} of model.lora.adapters"
    target = Path(path).expanduser().resolve()
    link = f", a symlink to {target}" if target != Path(path).expanduser().absolute() else ""
    return f"LoRA adapter {name} (model.lora.adapters.{name}={path}{link})"


def check_model_unchanged(run: Any) -> None:
    """Refuse to go on with a run (a RunDir) whose model folder changed since prepare (hashed as
    its record was: model.identity at prepare)."""
    recorded = recorded_identity(run.run.get(KEY))
    if recorded is None:
        return
    model = run.config.model
    now = identity_of(model.path, model.revision, model.lora.adapters, recorded.mode)
    refuse_changed_model(run.path, run.run, now, model.lora.adapters)
