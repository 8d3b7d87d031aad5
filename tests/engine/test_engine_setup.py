"""Starting the shared in-process engine leaves the environment as it was."""

from __future__ import annotations

import os
from typing import Any

import pytest


@pytest.mark.engine
def test_starting_an_engine_leaves_no_logging_level_for_children(engine: Any) -> None:
    """Left in os.environ, the WARNING set for the engine's start reads as the user's own choice in
    every later `batchinfer` child, which then keeps vLLM's noise on the console."""
    from batchinfer.engine.output import USER_VLLM_LOGGING_LEVEL

    assert os.environ.get("VLLM_LOGGING_LEVEL") == USER_VLLM_LOGGING_LEVEL
