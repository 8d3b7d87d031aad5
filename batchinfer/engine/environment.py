"""The environment vLLM's processes start in (set before an engine, or a node's ranks, start)."""

from __future__ import annotations

import logging
import os

from batchinfer.versions import cpu_build

log = logging.getLogger("batchinfer")


def engine_environment() -> None:
    """The environment vLLM starts in, set where the user did not set it."""
    if cpu_build() and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        # Without it the CPU backend reserves 90% of the node's memory and may refuse to start.
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = "4"
        log.info("VLLM_CPU_KVCACHE_SPACE unset: using 4 GiB of KV cache on CPU")
    # Weights come from a local folder or the login node's pre-downloaded cache, never the hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
