"""input.path resolved to files: a file, a glob, a `save_to_disk` folder, a hub dataset's split."""

from __future__ import annotations

import os
from pathlib import Path

from batchinfer.errors import InputError
from batchinfer.models.locations import looks_local

GLOB_CHARS = set("*?[")
HUB_PREFIX = "hf://datasets/"


def input_files(path: str, split: str = "train") -> list[Path]:
    """input.path resolved: a file, a glob of files (sorted), a `save_to_disk` folder, or a hub
    dataset's files for one split."""
    # Absolute, not resolved: a hub snapshot's files are symlinks to suffix-less blobs.
    if looks_like_hub_dataset(path):
        return hub_dataset_files(path, split)
    if GLOB_CHARS & set(path):
        base = Path(path).expanduser()
        if not base.is_absolute():
            base = Path.cwd() / base
        matches = Path(base.anchor).glob(str(base.relative_to(base.anchor)))
        files = sorted(Path(os.path.abspath(p)) for p in matches if p.is_file())
        if not files:
            raise InputError(f"input.path {path}: the pattern matches no file")
        return files
    p = Path(os.path.abspath(Path(path).expanduser()))
    if not p.exists():
        raise InputError(f"input.path {path}: no such file (resolved to {p})")
    if not os.access(p, os.R_OK):
        raise InputError(f"input.path {path}: not readable (permission denied; resolved to {p})")
    if p.is_dir() and not is_saved_dataset(p):
        raise InputError(f"input.path {path}: a folder, but not a `Dataset.save_to_disk` folder; give a file or a glob")
    return [p]


def looks_like_hub_dataset(path: str) -> bool:
    """hf://datasets/org/name[@rev], or org/name when no such local path exists."""
    if path.startswith(HUB_PREFIX):
        return True
    return not looks_local(path) and not GLOB_CHARS & set(path) and not Path(path).suffix


def hub_dataset_files(name: str, split: str) -> list[Path]:
    """A hub dataset's data files for one split: downloaded when the hub is reachable, else (and
    always with HF_HUB_OFFLINE=1) taken from the local Hugging Face cache."""
    from datasets.data_files import get_data_patterns, resolve_pattern
    from huggingface_hub import snapshot_download

    repo, _, revision = name.removeprefix(HUB_PREFIX).partition("@")
    try:
        snap = snapshot_download(repo, repo_type="dataset", revision=revision or None)
    except Exception as e:  # offline and not cached, unknown repo, gated, network down: one message
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(
            f"input.path {name}: no such local file, and the hub dataset {repo!r} could not be "
            f"fetched ({reason}). Offline (HF_HUB_OFFLINE=1) only the local cache is used: run "
            f"`huggingface-cli download --repo-type dataset {repo}` where the hub is reachable "
            f"(HF_TOKEN for gated data), or give a local file"
        ) from None
    patterns = get_data_patterns(snap)
    if split not in patterns:
        raise InputError(f"input.path {name}: no split {split!r} (splits: {', '.join(patterns)}); set input.split")
    found = {f for pattern in patterns[split] for f in resolve_pattern(pattern, base_path=snap)}
    return sorted(Path(f) for f in found)


def is_saved_dataset(path: Path) -> bool:
    """Whether a folder was written by `datasets.Dataset.save_to_disk`."""
    return (path / "state.json").is_file() and (path / "dataset_info.json").is_file()
