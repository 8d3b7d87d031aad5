"""What `model.dtype: auto` means where the engine runs, settled once per run directory.

On a CPU, vLLM's `auto` keeps a bf16 checkpoint in bf16, which CPUs without bf16 instructions
run through slow fallback kernels (~30x slower measured on an AVX2-only EPYC). So `auto` is
resolved here: on CPU, bfloat16 only where the CPU has bf16 instructions, else float32; on a GPU,
vLLM's own choice (the model's dtype). The first task of a run records its choice in
DIR/dtype.json; later tasks and resumes adopt it, so every shard of a run uses one dtype whatever
node it lands on. The fingerprint keeps the configured value (`auto`).
"""

from __future__ import annotations

import logging
import os
import platform
import socket
import time
from pathlib import Path
from typing import Any, Optional

from batchinfer.config.schema import Config
from batchinfer.durable import create_once, read_json
from batchinfer.redaction import record_json
from batchinfer.versions import cpu_build

log = logging.getLogger("batchinfer")

DTYPE_FILE = "dtype.json"
X86_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_info(text: Optional[str] = None) -> tuple[str, set[str]]:
    """(CPU model name, feature flags) from /proc/cpuinfo (x86 `flags`, aarch64 `Features`)."""
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            text = ""
    name, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not name:
            name = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    return name or platform.machine(), flags


def cpu_has_bf16(flags: set[str], machine: Optional[str] = None) -> bool:
    """Whether a CPU with these flags has bf16 instructions."""
    machine = machine or platform.machine()
    if machine in ("aarch64", "arm64"):
        return "bf16" in flags
    return any(f in flags for f in X86_BF16_FLAGS)


def on_gpu() -> bool:
    """Whether this process's engine runs on a GPU (the GPU build of vLLM and a visible GPU)."""

    if cpu_build():
        return False
    import torch  # the worker imports it with vllm anyway

    return bool(torch.cuda.is_available())


def own_choice(gpu: Optional[bool] = None, cpuinfo: Optional[str] = None) -> dict[str, Any]:
    """What `auto` means on this machine: {"dtype", "why"}."""
    if gpu if gpu is not None else on_gpu():
        return {"dtype": "auto", "why": "GPU: vLLM takes the model's own dtype"}
    name, flags = cpu_info(cpuinfo)
    if cpu_has_bf16(flags):
        found = sorted(f for f in flags if f in (*X86_BF16_FLAGS, "bf16"))
        return {"dtype": "bfloat16", "why": f"CPU with bf16 instructions ({', '.join(found)}): {name}"}
    return {
        "dtype": "float32",
        "why": f"CPU without bf16 instructions (no avx512_bf16/amx_bf16 flag), where bf16 is ~30x slower: {name}",
    }


def has_committed_rows(run_path: Path) -> bool:
    """Whether any shard of the run has committed rows (a part or a DONE.json)."""
    shards = run_path / "shards"
    return any(True for _ in shards.glob("*/part-*")) or any(True for _ in shards.glob("*/DONE.json"))


def settle(run_path: Path, configured: str) -> str:
    """The dtype this run's engine uses: the configured one unless `auto`; for `auto` the one in
    DIR/dtype.json, which the first task writes from its own choice."""
    if configured != "auto":
        return configured
    path = run_path / DTYPE_FILE
    mine = own_choice()
    if not path.is_file():
        if has_committed_rows(run_path):
            # Made by a version that passed `auto` to vLLM: its parts used vLLM's choice, so keep it.
            mine = {"dtype": "auto", "why": "run directory made before batchinfer resolved auto: vLLM's choice"}
        record = {**mine, "configured": configured, "host": socket.gethostname(), "time": time.time()}
        if create_once(path, (record_json(record, indent=2, sort_keys=True) + "\n").encode()):
            log.info("model.dtype auto -> %s (%s); recorded in %s", mine["dtype"], mine["why"], path)
            return str(mine["dtype"])
    record = read_json(path)
    if record["dtype"] != mine["dtype"]:
        log.warning(
            "model.dtype auto -> %s, as recorded in %s by %s (%s); this node would have chosen %s (%s)",
            record["dtype"],
            path,
            record.get("host"),
            record.get("why"),
            mine["dtype"],
            mine["why"],
        )
    return str(record["dtype"])


def device_name() -> str:
    """The GPU model (and count), or the CPU model when running on CPU."""
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return f"CPU: {cpu_info()[0]} ({os.cpu_count()} cores)"


def engine_dtype(cfg: Config, dtype: Optional[str]) -> str:
    """The dtype the engine runs: the run's settled one, else model.dtype (`auto` for this machine)."""
    if dtype is not None:
        return dtype
    return own_choice()["dtype"] if cfg.model.dtype == "auto" else cfg.model.dtype
