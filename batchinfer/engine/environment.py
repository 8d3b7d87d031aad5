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
    if cpu_build() and "VLLM_USE_AOT_COMPILE" not in os.environ:
        # vllm-cpu 0.32 compiles with torch's own "inductor" backend (its platforms/cpu.py), whose AOT
        # artifact vLLM saves but cannot load ("'function' object has no attribute 'finalize_loading'",
        # compilation/decorators.py): every start failed to load it, traced and compiled again, and
        # wrote it again into the shared cache. Without AOT the compile goes through Inductor's own
        # caches (TORCHINDUCTOR_CACHE_DIR, in the cache folder: compile_cache.cache_env), which a
        # later start loads (benchmarks/results/cache_storm.md).
        os.environ["VLLM_USE_AOT_COMPILE"] = "0"
    # Weights come from a local folder or the login node's pre-downloaded cache, never the hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
