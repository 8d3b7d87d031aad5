"""Settings the model cannot take, read from its folder before anything runs: model.max_model_len
above its limit, task=classify without classes, task.dimensions it cannot give. vLLM refuses
these at engine start, after a job waited in the queue (or after every row of a local run was
read); compose checks them, so `run`, `submit`, `plan` and `validate` refuse alike."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig

from batchinfer.config.schema import POOLING_TASKS
from batchinfer.errors import ConfigError
from batchinfer.models.maxlen import ALLOW_LONG_ENV, check_max_model_len
from batchinfer.models.pooling import check_pooling_model


def local_model_folder(path: Optional[str], revision: Optional[str]) -> Optional[Path]:
    """The model's folder when it is on this machine; None otherwise (prepare and validate name a
    missing model with how to get it, so it is not this check's to report)."""
    from batchinfer.models.tokens import model_dir

    if not path:
        return None
    try:
        folder = model_dir(path, revision)
    except ConfigError:
        return None
    return folder if (folder / "config.json").is_file() else None


def allow_long(cfg: DictConfig) -> bool:
    """VLLM_ALLOW_LONG_MAX_MODEL_LEN as vLLM reads it, from cluster.env or this environment."""
    value = (cfg.cluster.env or {}).get(ALLOW_LONG_ENV, os.environ.get(ALLOW_LONG_ENV, "0"))
    return str(value).strip().lower() in ("1", "true")


def check_model_fit(cfg: DictConfig) -> None:
    """ConfigError naming the key when the model folder cannot take a setting of cfg."""
    folder = local_model_folder(cfg.model.path, cfg.model.revision)
    if folder is None:
        return
    check_max_model_len(cfg.model.max_model_len, folder, allow_long(cfg))
    if cfg.task.name in POOLING_TASKS:
        check_pooling_model(cfg.task.name, cfg.task.dimensions, folder)
