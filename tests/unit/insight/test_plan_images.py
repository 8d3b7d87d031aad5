"""`plan` of a vision-language model: the vision encoder's weights from its config (the count the
tiny Idefics3's real weights have), the largest image's tokens and encoder cache, and the prompts'
image tokens in the token lengths the KV sizing uses."""

from __future__ import annotations

import json
from pathlib import Path

from support import tiny_vlm

from batchinfer.config.compose import compose
from batchinfer.insight.plan import estimate
from batchinfer.insight.plan_text import format_plan
from batchinfer.models import sizing

# The tiny Idefics3's vision tower and connector: the safetensors headers of tiny_vlm.build's
# weights count 491,072 parameters, config.json's text model 340,992.
VISION_PARAMS = 491_072 - 340_992


def test_plan_sizes_the_vision_encoder_and_counts_image_tokens(tmp_path: Path) -> None:
    model = tmp_path / "vlm"
    tiny_vlm.write_processor(model, split=(192, 64))  # no weights: sized from config.json
    for i in range(4):
        tiny_vlm.write_image(tmp_path / "img" / f"{i}.png", i, size=48)
    rows = [{"id": i, "text": "describe this picture", "image": f"img/{i}.png"} for i in range(4)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = compose(
        [
            f"input.path={tmp_path / 'c.jsonl'}",
            f"model.path={model}",
            "prompt.image_column=image",
            "model.max_model_len=512",
        ]
    )
    report = estimate(cfg)
    ms = report["model"]
    text = sizing.config_params(json.loads((model / "config.json").read_text()))
    assert text == 340_992
    v = ms["vision"]
    assert v is not None and v["params"] == VISION_PARAMS
    assert ms["params"] == text + VISION_PARAMS and ms["params_source"] == "config.json, vision_config included"
    # 192 px scaled, 64 px tiles: 3 x 3 tiles and the whole image, 4 embeddings each
    assert (v["max_image_tokens"], v["embedded_tokens"]) == (65, 40)
    assert v["encoder_cache_bytes_per_image"] == 40 * 128 * 2  # text hidden 128, bfloat16
    # a 48 px picture is cut into 3 x 3 tiles as well: 74 prompt tokens, as vLLM's processor makes them
    pt = report["prompt_tokens"]
    assert pt is not None and (pt["mean"], pt["max"]) == (74.0, 74)
    text_out = format_plan(report)
    assert "vision   2-layer ViT, hidden 64, 16 px patches of 64 px images: 0.2M parameters" in text_out
    assert "the largest image: 65 prompt tokens (40 image embeddings), 10.0 KiB of encoder cache" in text_out
    assert "image tokens: 4 per tile, cut into tiles of 64 px after scaling its longest edge to 192 px" in text_out


def test_a_text_model_has_no_vision_section(tmp_path: Path) -> None:
    from support.model_configs import LLAMA_8B

    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps(LLAMA_8B))
    cfg = compose([f"model.path={tmp_path / 'llama'}"])
    report = estimate(cfg)
    assert report["model"]["vision"] is None and "vision " not in format_plan(report)
