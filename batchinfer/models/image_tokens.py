"""The prompt tokens an image takes, from the model folder's config and processor files alone (no
torch, no vllm: validate and plan count them on a login node).

The chat template places one image token; the engine's processor replaces it with the image's
tokens. How many:
- Idefics3 (SmolVLM): `image_seq_len` tokens per tile (processor_config.json, else from the vision
  config: (image_size / patch_size)^2 / scale_factor^2). Without splitting one tile; with
  `do_image_splitting` the image is scaled so its longest edge is `size.longest_edge`, cut into
  tiles of `max_image_size.longest_edge`, rows x cols of them plus the whole image. The replacement
  text (tile markers, row breaks, the image tokens) is built as vLLM builds it
  (Idefics3ProcessingInfo.get_image_repl) and counted with the model's tokenizer: exact.
- Other models: a fixed count per image where the config says it (`image_seq_length`,
  `num_image_tokens`, `mm_tokens_per_image`, `image_seq_len`, `num_query_tokens` in config.json,
  preprocessor_config.json or processor_config.json), whatever the image's size (models that tile by
  size count more for a large image: a lower bound).
- Otherwise unknown: each image counts as its one placeholder token, and plan and validate say so.
`model.engine_kwargs.mm_processor_kwargs` that change the processor are not applied here."""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from batchinfer.models.model_files import read_model_json

IDEFICS3 = ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration")
FIXED_KEYS = ("image_seq_length", "num_image_tokens", "mm_tokens_per_image", "image_seq_len", "num_query_tokens")
MAX_IMAGE_SIDE = 4096  # transformers' Idefics3 MAX_IMAGE_SIZE: no side is scaled past it


class Method(enum.Enum):
    """How an image's tokens are known."""

    IDEFICS3 = "idefics3 tiles"
    FIXED = "fixed per image"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class ImageTokenRule:
    """What a model folder says about an image's tokens; `source` names the file and key."""

    method: Method
    per_tile: int = 0  # Idefics3: tokens per tile; FIXED: tokens per image
    longest_edge: int = 0  # Idefics3 with splitting: the image's longest edge is scaled to this
    tile_edge: int = 0  # Idefics3 with splitting: a tile's edge
    split: bool = False
    source: str = ""

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """Idefics3: the rows and columns of tiles an image is cut into ((0, 0): one tile, not cut);
        as transformers' Idefics3ImageProcessor.get_number_of_image_patches."""
        if not self.split or width <= 0 or height <= 0:
            return 0, 0
        height, width = _rescale_to_max_len(height, width, self.longest_edge)
        height, width = _scale_below(height, width, MAX_IMAGE_SIDE)
        rows, cols = math.ceil(height / self.tile_edge), math.ceil(width / self.tile_edge)
        return (rows, cols) if rows > 1 or cols > 1 else (0, 0)

    def replacement(self, width: int, height: int) -> str:
        """Idefics3: the text vLLM puts in place of the image token (Idefics3ProcessingInfo.get_image_repl)."""
        image = "<image>" * self.per_tile
        fake, whole = "<fake_token_around_image>", "<global-img>"
        rows, cols = self.grid(width, height)
        if rows == 0 and cols == 0:
            return fake + whole + image + fake
        parts = []
        for i in range(rows):
            for j in range(cols):
                parts.append(f"{fake}<row_{i + 1}_col_{j + 1}>{image}")
            parts.append("\n")
        return "".join([*parts, "\n", fake, whole, image, fake])


def _rescale_to_max_len(height: int, width: int, max_len: int) -> tuple[int, int]:
    aspect = width / height
    if width >= height:
        width, height = max_len, int(max_len / aspect)
        height += height % 2
    else:
        height, width = max_len, int(max_len * aspect)
        width += width % 2
    return max(height, 1), max(width, 1)


def _scale_below(height: int, width: int, max_len: int) -> tuple[int, int]:
    aspect = width / height
    if width >= height and width > max_len:
        width, height = max_len, int(max_len / aspect)
    elif height > width and height > max_len:
        height, width = max_len, int(max_len * aspect)
    return max(height, 1), max(width, 1)


def _json(path: Path) -> dict[str, Any]:
    """A JSON file of the model folder (models/model_files.py reads it; a missing one is empty)."""
    value = read_model_json(path) if path.is_file() else {}
    return value if isinstance(value, dict) else {}


def _edge(value: Any) -> int:
    if isinstance(value, dict):
        value = value.get("longest_edge", value.get("height", 0))
    return int(value) if isinstance(value, (int, float)) else 0


def image_token_rule(folder: Path) -> ImageTokenRule:
    """What folder's config.json, preprocessor_config.json and processor_config.json say of an image's tokens."""
    config = _json(folder / "config.json")
    processor = _json(folder / "processor_config.json")
    preprocessor = _json(folder / "preprocessor_config.json")
    images = {**preprocessor, **(processor.get("image_processor") or {})}
    if set(config.get("architectures") or []) & set(IDEFICS3):
        vision = config.get("vision_config") or {}
        per_tile, source = processor.get("image_seq_len"), "processor_config.json image_seq_len"
        if not isinstance(per_tile, int):
            side = int(vision.get("image_size", 0)) // max(int(vision.get("patch_size", 1)), 1)
            per_tile = side * side // max(int(config.get("scale_factor", 1)), 1) ** 2
            source = "config.json vision_config image_size / patch_size, scale_factor"
        split = bool(images.get("do_image_splitting", True))
        longest, tile = _edge(images.get("size")), _edge(images.get("max_image_size"))
        if per_tile > 0 and (not split or (longest > 0 and tile > 0)):
            where = "preprocessor config" if split else "preprocessor config: do_image_splitting false"
            return ImageTokenRule(Method.IDEFICS3, per_tile, longest, tile, split, f"{source}; {where}")
    named = (
        ("config.json", config),
        ("config.json vision_config", config.get("vision_config") or {}),
        ("preprocessor_config.json", preprocessor),
        ("processor_config.json", processor),
        ("processor_config.json image_processor", processor.get("image_processor") or {}),
    )
    for name, record in named:
        for key in FIXED_KEYS:
            if isinstance(record.get(key), int) and record[key] > 0:
                return ImageTokenRule(Method.FIXED, record[key], source=f"{name} {key}")
    return ImageTokenRule(Method.UNKNOWN, source="none of " + ", ".join(FIXED_KEYS) + " in the model's config files")


class ImageTokens:
    """A model's image token counts: `extra(width, height)`, the tokens an image adds beyond its one
    placeholder token (None: unknown); Idefics3 replacements counted with the model's tokenizer."""

    def __init__(self, rule: ImageTokenRule, count_text: Optional[Callable[[str], int]]) -> None:
        self.rule = rule
        self._count_text = count_text
        self._memo: dict[tuple[int, int], int] = {}

    @property
    def known(self) -> bool:
        """Whether the count is known (else an image counts as its placeholder)."""
        return self.rule.method is not Method.UNKNOWN and (
            self.rule.method is not Method.IDEFICS3 or self._count_text is not None
        )

    def tokens(self, width: int, height: int) -> Optional[int]:
        """The prompt tokens one image of this size takes (its placeholder replaced); None: unknown."""
        rule = self.rule
        if rule.method is Method.FIXED:
            return rule.per_tile
        if rule.method is not Method.IDEFICS3 or self._count_text is None:
            return None
        grid = rule.grid(width, height)
        if grid not in self._memo:  # the text depends on the grid alone
            self._memo[grid] = self._count_text(rule.replacement(width, height))
        return self._memo[grid]

    def note(self) -> str:
        """One line for plan and validate: how an image's tokens are counted, or that they are not."""
        r = self.rule
        if r.method is Method.IDEFICS3 and self.known:
            cut = (
                f"cut into tiles of {r.tile_edge} px after scaling its longest edge to {r.longest_edge} px, plus the whole"
                if r.split
                else "one tile"
            )
            return f"image tokens: {r.per_tile} per tile, {cut} ({r.source}), counted with their markers"
        if r.method is Method.FIXED:
            return f"image tokens: {r.per_tile} per image ({r.source})"
        return (
            f"image tokens unknown ({r.source}): each image counted as its one placeholder token; the "
            "engine's prompts are longer by the image's tokens, which max_model_len must hold"
        )

    def extra(self, width: int, height: int) -> int:
        """Tokens the image adds to a prompt counted with its one placeholder (0: unknown)."""
        n = self.tokens(width, height)
        return n - 1 if n is not None else 0


@functools.lru_cache(maxsize=8)
def model_image_tokens(path: str, revision: Optional[str]) -> ImageTokens:
    """The image token counts of model.path at revision (its local folder)."""
    from batchinfer.models.tokens import model_dir

    try:
        folder = model_dir(path, revision)
    except Exception:  # a model the engine finds its own way (a worker must not fail a row on this)
        return ImageTokens(ImageTokenRule(Method.UNKNOWN, source=f"no local folder of {path}"), None)
    return image_tokens(str(folder))


@functools.lru_cache(maxsize=8)
def image_tokens(folder: str) -> ImageTokens:
    """The image token counts of a model folder (its tokenizer.json counts Idefics3 replacements)."""
    path = Path(folder)
    rule = image_token_rule(path)
    count_text = None
    if rule.method is Method.IDEFICS3 and (path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception:  # `tokenizers` raises untyped errors; counting then stays unknown
            tok = None
        if tok is not None:
            tok.no_padding()
            tok.no_truncation()
            count_text = lambda text: len(tok.encode(text, add_special_tokens=False).ids)  # noqa: E731
    return ImageTokens(rule, count_text)
