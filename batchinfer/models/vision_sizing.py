"""A vision-language model's vision encoder sized from config.json alone (for `plan`): its weights
(a ViT of vision_config: patch embedding, positions, layers, final norm; the connector projecting
its features into the language model), the tokens of the largest image its processor makes, and
the encoder cache one such image takes in vLLM (its image tokens' embeddings, text hidden size, in
the model's dtype; vLLM keeps room for max(max_num_batched_tokens, one image's tokens) of them)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from batchinfer.models.image_tokens import Method, image_tokens


@dataclass(frozen=True)
class VisionEncoder:
    """The vision tower's shape and size, and what one image costs the engine."""

    layers: int
    hidden: int
    intermediate: int
    patch: int
    image_size: int
    params: int  # the tower and the connector into the language model
    max_image_tokens: Optional[int]  # prompt tokens of the largest image (markers included); None: unknown
    embedded_tokens: Optional[int]  # of those, the image's embeddings (the encoder cache's tokens)
    cache_bytes_per_image: Optional[int]  # embedded_tokens x text hidden x dtype bytes


def vit_params(v: dict[str, Any]) -> int:
    """Parameters of a ViT (SigLIP, CLIP): patch embedding with bias, one position per patch, layers of
    q/k/v/o and a two-matrix MLP with biases and two LayerNorms, and the final LayerNorm."""
    h, inter, patch = (
        int(v["hidden_size"]),
        int(v.get("intermediate_size") or 4 * v["hidden_size"]),
        int(v["patch_size"]),
    )
    channels, side = int(v.get("num_channels", 3)), int(v["image_size"]) // patch
    embed = channels * patch * patch * h + h + side * side * h
    layer = 4 * h * h + 4 * h + 2 * h * inter + inter + h + 4 * h
    return embed + int(v["num_hidden_layers"]) * layer + 2 * h


def vision_encoder(folder: Path, cfg: dict[str, Any], elem_bytes: int) -> Optional[VisionEncoder]:
    """The vision encoder of the model in folder (its config.json as cfg), or None: no vision_config,
    or one without a ViT's shape."""
    v, text = cfg.get("vision_config"), cfg.get("text_config") or cfg
    if not isinstance(v, dict):
        return None
    try:
        params = vit_params(v)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    scale = int(cfg.get("scale_factor") or 1)
    text_hidden = int(text.get("hidden_size") or 0)
    params += int(v["hidden_size"]) * scale * scale * text_hidden  # Idefics3's connector: no bias
    counts = image_tokens(str(folder))
    rule = counts.rule
    largest = rule.longest_edge if rule.split else int(v["image_size"])
    total = counts.tokens(largest, largest) if counts.known else None
    embedded = None
    if rule.method is Method.IDEFICS3 and total is not None:
        rows, cols = rule.grid(largest, largest)
        embedded = rule.per_tile * (rows * cols + 1 if rows else 1)
    elif rule.method is Method.FIXED:
        embedded = rule.per_tile
    cache = embedded * text_hidden * elem_bytes if embedded is not None and text_hidden else None
    return VisionEncoder(
        int(v["num_hidden_layers"]),
        int(v["hidden_size"]),
        int(v.get("intermediate_size") or 4 * v["hidden_size"]),
        int(v["patch_size"]),
        int(v["image_size"]),
        params,
        total,
        embedded,
        cache,
    )
