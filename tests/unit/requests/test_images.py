"""A row's image (requests/images.py): where it is, its bytes, digest and pixels, the chat part it
makes, the error rows of bad images; and a run on the fake engine (each image's digest reaches the
engine with its request; one picture under two paths is one request)."""

from __future__ import annotations

import base64
import io
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from support import tiny_vlm
from support.corpus import read_output, write_rows
from support.fake_engine import FakeEngine, fake_overrides

from batchinfer.config.compose import compose
from batchinfer.config.fingerprint import fingerprint_keys
from batchinfer.config.schema import to_config
from batchinfer.engine.vllm_engine import model_key
from batchinfer.inputs.convert import open_input
from batchinfer.insight.row_check import check_rows
from batchinfer.launch.local import run_local
from batchinfer.requests.images import ImageLimits, Source, image_digest, image_ref, row_image, with_image
from batchinfer.requests.prompts import RowError

LIMITS = ImageLimits(Path("/data"), max_bytes=10_000, max_pixels=10_000)


def png(index: int = 0, size: int = 32) -> bytes:
    """A small PNG's bytes."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (size, size), tiny_vlm.COLOURS[index]).save(buf, format="PNG")
    return buf.getvalue()


def test_where_an_image_is() -> None:
    assert image_ref("a/b.png", "img", LIMITS).path == Path("/data/a/b.png")  # relative to the input's folder
    assert image_ref("/abs/c.png", "img", LIMITS).path == Path("/abs/c.png")
    ref = image_ref("file:///x/my%20pic.png", "img", LIMITS)
    assert (ref.source, ref.path) == (Source.FILE_URL, Path("/x/my pic.png"))
    data = png()
    ref = image_ref("data:image/png;base64," + base64.b64encode(data).decode(), "img", LIMITS)
    assert (ref.source, ref.data) == (Source.DATA_URL, data)
    assert image_ref(data, "img", LIMITS).data == data
    assert image_ref({"bytes": data, "path": None}, "img", LIMITS).data == data  # the datasets Image feature
    assert image_ref({"bytes": None, "path": "p.png"}, "img", LIMITS).path == Path("/data/p.png")


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (None, "field 'img' is null"),
        (3, "field 'img' is int 3"),
        ("https://example.com/a.png", "not fetched unless the config allows it (prompt.image_http=true)"),
        ("data:text/plain;base64,aGk=", "not a base64 image"),
        ("data:image/png;base64,@@@", "does not decode"),
        ({"bytes": None, "path": None}, "without bytes or path"),
    ],
)
def test_a_value_naming_no_image_is_a_row_error(value: Any, says: str) -> None:
    with pytest.raises(RowError) as e:
        image_ref(value, "img", LIMITS)
    assert e.value.kind == "image" and says in e.value.message


def test_bad_images_are_row_errors_naming_the_file(tmp_path: Path) -> None:
    limits = ImageLimits(tmp_path, max_bytes=10_000, max_pixels=10_000)
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "junk.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"junk" * 10)
    (tmp_path / "cut.png").write_bytes(png(1)[:60])  # a truncated file
    (tmp_path / "wide.png").write_bytes(png(2, size=101))  # 10,201 pixels
    (tmp_path / "big.bin").write_bytes(png() + b"\0" * 10_000)
    cases = {
        "nope.png": "no such file",
        "empty.png": "is empty (0 bytes)",
        "junk.png": "does not decode as an image",
        "cut.png": "does not decode as an image",
        "wide.png": "is 101x101 pixels, over prompt.image_max_pixels=10,000",
        "big.bin": "over prompt.image_max_bytes=10,000",
        ".": "is a folder",
    }
    for name, says in cases.items():
        with pytest.raises(RowError) as e:
            row_image({"img": name}, "img", limits)
        assert e.value.kind == "image", name
        assert str(tmp_path / name).rstrip("/.") in e.value.message and says in e.value.message, e.value.message


def test_an_image_is_its_bytes_digest_and_pixels(tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(png(3))
    (tmp_path / "sub").mkdir()
    shutil.copy(tmp_path / "a.png", tmp_path / "sub" / "b.png")
    limits = ImageLimits(tmp_path, max_bytes=10_000, max_pixels=10_000)
    a = row_image({"img": "a.png"}, "img", limits)
    b = row_image({"img": "sub/b.png"}, "img", limits)
    assert a.digest == b.digest == image_digest(png(3)) != image_digest(png(4))
    assert (a.width, a.height, a.pixels.mode, a.pixels.getpixel((0, 0))) == (32, 32, "RGB", tiny_vlm.COLOURS[3])
    assert row_image({"img": "a.png"}, "img", limits, decode=False).pixels is None


def test_the_image_part_comes_first_in_the_last_user_turn() -> None:
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "describe"}]
    assert with_image(chat) == [
        chat[0],
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "describe"}]},
    ]
    with pytest.raises(RowError, match="needs a chat prompt"):
        with_image("raw text")


def write_image_rows(d: Path) -> list[dict[str, Any]]:
    """Six rows: three pictures, one of them also under a second path, a missing and a corrupt image."""
    (d / "img").mkdir()
    for i in range(3):
        (d / "img" / f"{i}.png").write_bytes(png(i))
    shutil.copy(d / "img" / "1.png", d / "img" / "again.png")
    (d / "img" / "bad.png").write_bytes(b"GIF89a broken")
    rows = [
        {"id": "a", "text": "what colour", "image": "img/0.png"},
        {"id": "b", "text": "what colour", "image": "img/1.png"},
        {"id": "c", "text": "what colour", "image": "img/2.png"},
        {"id": "d", "text": "what colour", "image": f"file://{d / 'img' / 'again.png'}"},
        {"id": "e", "text": "what colour", "image": "img/missing.png"},
        {"id": "f", "text": "what colour", "image": "img/bad.png"},
    ]
    write_rows(d / "c.jsonl", rows)
    return rows


def test_a_run_sends_each_image_once_with_its_request(tmp_path: Path) -> None:
    write_image_rows(tmp_path)
    eng = FakeEngine()
    cfg = compose(fake_overrides(tmp_path, tmp_path / "c.jsonl", "input.id_column=id", "prompt.image_column=image"))
    eng.key = model_key(to_config(cfg))  # type: ignore[attr-defined]  # the engine a run checks it was given
    run = run_local(cfg, engine=eng)
    out = {r["id"]: r for r in read_output(run.path)}
    digests = [image_digest(png(i)) for i in range(3)]
    ids = eng.encode([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour"}]}])
    for id_, i in [("a", 0), ("b", 1), ("c", 2), ("d", 1)]:
        assert out[id_]["error"] is None and out[id_]["text"] == FakeEngine.answer(ids, None, digests[i]), id_
    assert len({out[k]["text"] for k in "abc"}) == 3  # the image decides the answer
    assert sorted(eng.images.values()) == sorted(digests)  # d's picture is b's: computed once
    assert set(eng.sizes) == {(32, 32)}
    assert out["e"]["error"]["kind"] == "image" and "img/missing.png: no such file" in out["e"]["error"]["message"]
    assert out["e"]["error"]["message"].startswith("row 4: image ")
    assert out["f"]["error"]["kind"] == "image" and "bad.png does not decode" in out["f"]["error"]["message"]
    # validate (no engine) names the same rows with the same messages
    found = check_rows(run.config, open_input(run.input_dir), FakeEngine(), 1000)
    assert {k: v["count"] for k, v in found.errors.kinds.items()} == {"image": 2}
    examples = found.errors.kinds["image"]["examples"]
    assert [e["message"] for e in examples] == [out["e"]["error"]["message"], out["f"]["error"]["message"]]


def test_runs_without_images_keep_their_fingerprint(tmp_path: Path) -> None:
    corpus = write_rows(tmp_path / "c.jsonl", [{"text": "x"}])
    plain = fingerprint_keys(json.loads(json.dumps(_plain(compose(fake_overrides(tmp_path, corpus))))), "fp")
    assert not [k for k in plain if k.startswith("prompt.image_")]
    cfg = compose(fake_overrides(tmp_path, corpus, "prompt.image_column=image"))
    keys = fingerprint_keys(json.loads(json.dumps(_plain(cfg))), "fp")
    assert keys["prompt.image_column"] == "image" and keys["prompt.image_max_bytes"] == 20 << 20


def _plain(cfg: Any) -> Any:
    from batchinfer.config.schema import to_dict

    return to_dict(cfg)


def test_openai_batch_image_url_parts_run(tmp_path: Path) -> None:
    """A data URL and a relative file in image_url parts reach the engine as their images."""
    from support.openai_batch import request

    (tmp_path / "0.png").write_bytes(png(0))
    data = "data:image/png;base64," + base64.b64encode(png(1)).decode()

    def body(url: str) -> dict[str, Any]:
        parts = [{"type": "text", "text": "what colour"}, {"type": "image_url", "image_url": {"url": url}}]
        return {"messages": [{"role": "user", "content": parts}]}

    (tmp_path / "batch.jsonl").write_text(request("file", body("0.png")) + request("data", body(data)))
    eng = FakeEngine()
    cfg = compose(fake_overrides(tmp_path, tmp_path / "batch.jsonl"))
    eng.key = model_key(to_config(cfg))  # type: ignore[attr-defined]
    run = run_local(cfg, engine=eng)
    out = {o["custom_id"]: o for o in map(json.loads, run.output_path.read_text().splitlines())}
    ids = eng.encode([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour"}]}])
    for cid, i in [("file", 0), ("data", 1)]:
        answer = out[cid]["response"]["body"]["choices"][0]["message"]["content"]
        assert answer == FakeEngine.answer(ids, None, image_digest(png(i))), cid
