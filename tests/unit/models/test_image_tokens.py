"""An image's prompt tokens from the model's files alone (models/image_tokens.py): Idefics3 tiles as
transformers' processor cuts them and vLLM's text around them, a fixed count where a config says
one, unknown otherwise; validate counts them and refuses a row its image makes overlong."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets
import pytest
from support import tiny_vlm
from support.fake_engine import fake_model_dir

from batchinfer.config.compose import compose
from batchinfer.config.schema import to_config
from batchinfer.insight.row_check import check_rows
from batchinfer.models.image_tokens import Method, image_token_rule, image_tokens
from batchinfer.models.tokens import LoginTokenizer

PER_TILE = tiny_vlm.IMAGE_SEQ_LEN  # 4


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Idefics3's files without weights: one tile per image."""
    out = tmp_path_factory.mktemp("vlm")
    tiny_vlm.write_processor(out)
    return out


@pytest.fixture(scope="module")
def vlm_split(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same, cutting images as SmolVLM does: longest edge scaled to 192, tiles of 64."""
    out = tmp_path_factory.mktemp("vlm-split")
    tiny_vlm.write_processor(out, split=(192, 64))
    return out


def test_one_tile_takes_its_tokens_and_three_markers(vlm: Path) -> None:
    t = image_tokens(str(vlm))
    assert t.rule.method is Method.IDEFICS3 and not t.rule.split and t.known
    # <fake_token_around_image><global-img><image>x4<fake_token_around_image>, whatever the size
    assert {t.tokens(w, h) for w, h in [(48, 48), (640, 480), (1, 1), (7, 300)]} == {PER_TILE + 3}
    assert t.extra(48, 48) == PER_TILE + 2
    assert t.note() == (
        "image tokens: 4 per tile, one tile (processor_config.json image_seq_len; preprocessor config: "
        "do_image_splitting false), counted with their markers"
    )


@pytest.mark.parametrize(
    ("size", "grid"),
    [((48, 48), (3, 3)), ((64, 32), (2, 3)), ((30, 130), (3, 1)), ((5000, 100), (1, 3)), ((1, 1), (3, 3))],
)
def test_a_split_image_takes_its_tiles_and_the_whole(
    vlm_split: Path, size: tuple[int, int], grid: tuple[int, int]
) -> None:
    t = image_tokens(str(vlm_split))
    assert t.rule.grid(*size) == grid
    rows, cols = grid
    # each tile: <fake><row_i_col_j> and its tokens; a line break after each row and one more; the whole image
    tiles = rows * cols * (2 + PER_TILE)
    breaks = len(LoginTokenizer.from_model_dir(vlm_split).tokenizer.encode("\n" * (rows + 1)).ids) if rows else 0
    assert t.tokens(*size) == tiles + breaks + PER_TILE + 3


def test_a_fixed_count_from_the_config_and_unknown_without(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["PaliGemmaForConditionalGeneration"]}))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"image_seq_length": 256}))
    rule = image_token_rule(tmp_path)
    assert (rule.method, rule.per_tile, rule.source) == (Method.FIXED, 256, "preprocessor_config.json image_seq_length")
    assert image_tokens(str(tmp_path)).extra(10, 10) == 255
    (tmp_path / "plain").mkdir()
    plain = fake_model_dir(tmp_path / "plain")
    t = image_tokens(str(plain))
    assert t.rule.method is Method.UNKNOWN and not t.known and t.extra(48, 48) == 0
    assert t.note().startswith("image tokens unknown (none of image_seq_length, num_image_tokens")
    assert "each image counted as its one placeholder token" in t.note()


def _rows(d: Path) -> list[dict[str, Any]]:
    tiny_vlm.write_image(d / "img" / "0.png", 0, size=48)
    return [{"id": "a", "text": "describe this picture", "image": "img/0.png"}]


def _check(d: Path, model: Path, max_len: int) -> Any:
    rows = _rows(d)
    (d / "c.jsonl").write_text("")
    cfg = to_config(
        compose(
            [
                f"input.path={d / 'c.jsonl'}",
                f"model.path={model}",
                "input.id_column=id",
                "prompt.image_column=image",
                f"model.max_model_len={max_len}",
            ]
        )
    )
    tok = LoginTokenizer.from_model_dir(model)
    return cfg, tok, check_rows(cfg, datasets.Dataset.from_list(rows), tok, max_len)


def test_validate_counts_an_image_by_its_tiles_and_refuses_the_row_it_makes_overlong(
    tmp_path: Path, vlm_split: Path
) -> None:
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "describe this picture"}]}]
    text_tokens = len(LoginTokenizer.from_model_dir(vlm_split).encode(chat))
    image = image_tokens(str(vlm_split)).tokens(48, 48)
    assert image is not None and image > 60  # 3 x 3 tiles and the whole: far more than its placeholder
    _, _, found = _check(tmp_path, vlm_split, 512)
    assert dict(found.lengths) == {text_tokens - 1 + image: 1} and not found.errors.kinds
    # the text alone fits the window; with its image's tokens it does not
    _, _, found = _check(tmp_path, vlm_split, text_tokens + 10)
    assert found.overlong == 1
    (example,) = found.errors.kinds["overlong"]["examples"]
    assert example["message"] == (
        f"row 0: prompt has {text_tokens - 1 + image} tokens ({image} of them its 48x48 image's); "
        f"model.max_model_len is {text_tokens + 10}; raise model.max_model_len to {text_tokens + image} or more "
        "(the processor sizes the image)"
    )
