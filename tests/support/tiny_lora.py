"""Build a small PEFT LoRA adapter of the tiny Llama (tests/support/tiny_model.py): adapter_config.json
and adapter_model.safetensors as PEFT saves them, random non-zero A and B large enough that greedy
output differs from the base model's. Nothing is fetched.
usage: python tests/support/tiny_lora.py MODEL_DIR OUT_DIR [SEED]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RANK = 8
# module -> (in, out features) of the tiny Llama (hidden 128, 2 heads of 64, 1 KV head, MLP 256)
MODULES = {
    "self_attn.q_proj": (128, 128),
    "self_attn.v_proj": (128, 64),
    "self_attn.o_proj": (128, 128),
    "mlp.down_proj": (256, 128),
}
LAYERS = 2


def build(model: Path, out: Path, seed: int = 1, rank: int = RANK) -> Path:
    """Write the adapter to out (skipped when already there)."""
    if (out / "adapter_model.safetensors").is_file():
        return out
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model),
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "target_modules": sorted(m.split(".")[1] for m in MODULES),
    }
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(LAYERS):
        for module, (fan_in, fan_out) in MODULES.items():
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.5
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return out


if __name__ == "__main__":
    print(build(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 1))
