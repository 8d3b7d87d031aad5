"""The image tokens the login node counts (models/image_tokens.py, no vllm) are the prompt tokens
vLLM's own multimodal processor makes of an image row: the tiny Idefics3 with one tile per image and
cut into tiles as SmolVLM does, over sizes that give every grid shape. No engine starts."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Optional

import pytest
from support import tiny_vlm

from batchinfer.models.image_tokens import image_tokens
from batchinfer.models.tokens import LoginTokenizer

SIZES = [(48, 48), (64, 32), (200, 90), (30, 130), (640, 480), (7, 300), (1, 1), (5000, 100), (64, 64), (192, 10)]
CHAT = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "describe this picture"}]}]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
@pytest.mark.parametrize("split", [None, (192, 64)])
def test_image_tokens_equal_vllm_processor(tmp_path: Path, split: Optional[tuple[int, int]]) -> None:
    from PIL import Image
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.processing.context import TimingContext
    from vllm.multimodal.processing.inputs import ProcessorInputs

    tiny_vlm.write_processor(tmp_path, split)
    processor = MULTIMODAL_REGISTRY.create_processor(ModelConfig(model=str(tmp_path), dtype="float32"))
    ids = LoginTokenizer.from_model_dir(tmp_path).encode(CHAT)  # what validate counts: one placeholder
    counts = image_tokens(str(tmp_path))
    seen = set()
    for width, height in SIZES:
        items = processor.info.parse_mm_data({"image": [Image.new("RGB", (width, height))]})
        out = processor.apply(ProcessorInputs(list(ids), items), TimingContext(enabled=False))
        assert len(out["prompt_token_ids"]) == len(ids) + counts.extra(width, height), (width, height)
        seen.add(counts.rule.grid(width, height))
    # one tile; cut: every image is first scaled to a 192 edge, so 3x3, 2x3, 3x1 and 1x3 tiles
    assert seen == ({(0, 0)} if split is None else {(3, 3), (2, 3), (3, 1), (1, 3)})
