"""Which engine class a worker builds: vLLM's, or the stand-in a test names (faults.STANDIN_ENV)."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any

from batchinfer.faults import STANDIN_ENV


def engine_class() -> Callable[..., Any]:
    """The engine class workers build: vLLM's, or the stand-in BATCHINFER_STANDIN_ENGINE names."""
    name = os.environ.get(STANDIN_ENV)
    if not name:
        from batchinfer.engine.vllm_engine import Engine

        return Engine
    module, _, attr = name.partition(":")
    return getattr(importlib.import_module(module), attr)
