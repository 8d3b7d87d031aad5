"""Decoded images made ahead of the engine stay within cluster.image_window_mb: counted by the
pixels alive at every engine add and step (fake engine), not by the worker's own bookkeeping; and
an engine that processes images apart from add (vLLM's) has them processed ahead on their own thread."""

from __future__ import annotations

import threading
import weakref
from pathlib import Path
from typing import Any, Optional

import pytest
from PIL import Image
from support import tiny_vlm
from support.corpus import read_output, write_rows
from support.fake_engine import FakeEngine, fake_overrides

from batchinfer.config.compose import compose
from batchinfer.config.schema import to_config
from batchinfer.engine.image_ahead import ImageAhead, Processed
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


class ProcessingEngine(FakeEngine):
    """The fake engine with vLLM's split of an image's processing from add (Engine.process_image):
    it records the thread each image was processed on and what add was given."""

    def __init__(self) -> None:
        super().__init__()
        self.processed_on: list[str] = []
        self.events: list[str] = []  # "process <digest>" / "add <digest>", in order

    def process_image(self, token_ids: list[int], image: Any) -> Processed:
        self.processed_on.append(threading.current_thread().name)
        self.events.append(f"process {image[0]}")
        return Processed(image[0], {"size": image[1].size})

    def add(
        self, request_id: str, token_ids: list[int], params: Any, adapter: Optional[str] = None, image: Any = None
    ) -> None:
        assert image is None or isinstance(image, Processed), image  # never the decoded image itself
        if image is not None:
            self.events.append(f"add {image.digest}")
            image = (image.digest, Image.new("RGB", image.engine_input["size"]))
        super().add(request_id, token_ids, params, adapter, image)


def test_images_are_processed_ahead_on_their_own_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's image processing runs on the image thread, never on the main thread that steps the
    engine, and for the next requests before they are sent; the answers are each row's picture's."""
    for i in range(20):
        tiny_vlm.write_image(tmp_path / "img" / f"{i}.png", i)
    write_rows(
        tmp_path / "c.jsonl", [{"id": f"r{i}", "text": "what colour", "image": f"img/{i}.png"} for i in range(20)]
    )
    started_before_sent: list[bool] = []
    take = ImageAhead.take

    def spy(self: ImageAhead, key: Any) -> Processed:
        started_before_sent.append(key in self._jobs)
        return take(self, key)

    monkeypatch.setattr(ImageAhead, "take", spy)
    eng = ProcessingEngine()
    cfg = compose(fake_overrides(tmp_path, tmp_path / "c.jsonl", "input.id_column=id", "prompt.image_column=image"))
    eng.key = model_key(to_config(cfg))  # type: ignore[attr-defined]
    out = read_output(run_local(cfg, engine=eng).path)
    ids = eng.encode([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour"}]}])
    for i, r in enumerate(out):
        digest = image_digest((tmp_path / f"img/{i}.png").read_bytes())
        assert r["error"] is None and r["text"] == FakeEngine.answer(ids, None, digest)
    assert len(eng.processed_on) == 20 and set(eng.processed_on) == {"batchinfer-images_0"}
    for digest in {e.split()[1] for e in eng.events}:  # each processed once, before its add
        assert [e for e in eng.events if e.endswith(digest)] == [f"process {digest}", f"add {digest}"]
    # Started while earlier requests were sent: the first max_num_seqs after the first window was
    # read, then the queue's next ones at every step (the rest when sent, on the same thread).
    assert len(started_before_sent) == 20 and sum(started_before_sent) >= FakeEngine.max_num_seqs
