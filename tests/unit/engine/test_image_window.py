"""Decoded images made ahead of the engine stay within cluster.image_window_mb: counted by the
pixels alive at every engine add and step (fake engine), not by the worker's own bookkeeping."""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any, Optional

import pytest
from support import tiny_vlm
from support.corpus import read_output, write_rows
from support.fake_engine import FakeEngine, fake_overrides

from batchinfer.config.compose import compose
from batchinfer.config.schema import to_config
from batchinfer.engine.vllm_engine import model_key
from batchinfer.launch.local import run_local
from batchinfer.requests.images import image_digest

ROWS = 48
SIDE = 300  # 270,000 bytes of RGB pixels each: 3 fit in 1 MiB, 48 are 12.4 MiB


class CountingEngine(FakeEngine):
    """The fake engine, reading at every add and step the bytes of decoded images still alive."""

    def __init__(self, alive: list[weakref.ref[Any]]):
        super().__init__()
        self.alive = alive
        self.held: list[int] = []

    def _count(self) -> None:
        images = [im for im in (ref() for ref in list(self.alive)) if im is not None]
        self.held.append(sum(im.width * im.height * len(im.getbands()) for im in images))
        del images

    def add(
        self, request_id: str, token_ids: list[int], params: Any, adapter: Optional[str] = None, image: Any = None
    ) -> None:
        self._count()
        super().add(request_id, token_ids, params, adapter, image)

    def step(self) -> list[Any]:
        self._count()
        return super().step()


def run_images(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, window_mb: int) -> tuple[CountingEngine, list[dict]]:
    """ROWS rows, each its own SIDE x SIDE picture, on the counting engine with that image window."""
    from PIL import Image

    alive: list[weakref.ref[Any]] = []  # every image Pillow converted (decoded) meanwhile (PIL images are unhashable)
    convert = Image.Image.convert

    def counted(self: Any, *args: Any, **kw: Any) -> Any:
        out = convert(self, *args, **kw)
        alive.append(weakref.ref(out))
        return out

    monkeypatch.setattr(Image.Image, "convert", counted)
    d = tmp_path / f"w{window_mb}"
    for i in range(ROWS):
        tiny_vlm.write_image(d / "img" / f"{i}.png", i, size=SIDE)
    write_rows(d / "c.jsonl", [{"id": f"r{i}", "text": "what colour", "image": f"img/{i}.png"} for i in range(ROWS)])
    overrides = fake_overrides(d, d / "c.jsonl", "input.id_column=id", "prompt.image_column=image")
    eng = CountingEngine(alive)
    cfg = compose([*overrides, f"cluster.image_window_mb={window_mb}"])
    eng.key = model_key(to_config(cfg))  # type: ignore[attr-defined]  # the engine a run checks it was given
    out = read_output(run_local(cfg, engine=eng).path)
    monkeypatch.undo()
    return eng, out


def test_decoded_images_held_ahead_stay_within_the_image_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    eng, out = run_images(tmp_path, monkeypatch, 1)
    ids = eng.encode([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour"}]}])
    d = tmp_path / "w1"
    assert [r["id"] for r in out] == [f"r{i}" for i in range(ROWS)]
    for i, r in enumerate(out):  # every row answered with its own picture
        assert r["error"] is None and r["text"] == FakeEngine.answer(
            ids, None, image_digest((d / f"img/{i}.png").read_bytes())
        )
    assert len(eng.sizes) == ROWS and set(eng.sizes) == {(SIDE, SIDE)}
    assert max(eng.held) <= 1 << 20, max(eng.held)  # never more than the window's MiB alive

    unbounded, _ = run_images(tmp_path, monkeypatch, 1024)
    assert max(unbounded.held) > 4 << 20  # the count sees what a window holds when the budget allows it


def test_one_image_over_the_window_still_runs_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A picture bigger than the whole window is decoded when nothing else is held, not refused."""
    from PIL import Image

    d = tmp_path / "big"
    (d / "img").mkdir(parents=True)
    Image.new("RGB", (800, 800), (10, 20, 30)).save(d / "img" / "big.png")  # 1.9 MB of pixels
    tiny_vlm.write_image(d / "img" / "small.png", 1)
    rows = [{"id": "a", "text": "x", "image": "img/big.png"}, {"id": "b", "text": "y", "image": "img/small.png"}] * 3
    write_rows(d / "c.jsonl", [dict(r, id=f"{r['id']}{i}") for i, r in enumerate(rows)])
    eng = FakeEngine()
    cfg = compose(
        [
            *fake_overrides(d, d / "c.jsonl", "input.id_column=id", "prompt.image_column=image"),
            "cluster.image_window_mb=1",
        ]
    )
    eng.key = model_key(to_config(cfg))  # type: ignore[attr-defined]
    out = read_output(run_local(cfg, engine=eng).path)
    assert [r["error"] for r in out] == [None] * 6 and sorted(eng.sizes) == [(48, 48), (800, 800)]  # 2 requests
