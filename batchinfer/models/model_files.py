"""A model folder's JSON files (config.json, tokenizer_config.json, ...) read as one thing: a file
that is not JSON, not UTF-8, or a git-lfs pointer left for the real file is a ConfigError naming it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from batchinfer.errors import ConfigError

LFS_POINTER = b"version https://git-lfs.github.com/spec/"


def lfs_pointer_error(path: Path) -> ConfigError | None:
    """The error for a git-lfs pointer standing where the file's content should be, or None."""
    with open(path, "rb") as f:
        if f.read(len(LFS_POINTER)) != LFS_POINTER:
            return None
    return ConfigError(
        f"{path}: a git-lfs pointer, not the file itself; run `git lfs pull` in {path.parent} (or download the model again)"
    )


def read_model_json(path: Path) -> Any:
    """A JSON file of a model folder; ConfigError naming file:line:column where it is not JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        pointer = lfs_pointer_error(path)
        if pointer is not None:
            raise pointer from None
        where = f"{path}:{e.lineno}:{e.colno}" if isinstance(e, json.JSONDecodeError) else str(path)
        what = e.msg if isinstance(e, json.JSONDecodeError) else "invalid UTF-8"
        raise ConfigError(f"{where}: not valid JSON ({what}); copy the model folder again or fix the file") from None
