"""Image rows on the real engine (one tiny random Idefics3, support/tiny_vlm.py, started once for
this module): a run over image rows answers as vLLM's own LLM.chat with the same images, row for
row; bad images are error rows naming the row and the file, and the shard completes; the same
picture under two paths is computed once; a `batchinfer run` subprocess SIGKILLed inside an image
shard, then run again, answers every row once, its committed parts unchanged."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
from support import tiny_vlm
from support.corpus import project, read_output
from support.procs import group_alive, run_cli
from support.runs import (
    assert_only_missing_rows_redone,
    committed_parts_are_whole,
    committed_rows,
    model_overrides,
    recorded_commits,
)

from batchinfer.config.compose import compose
from batchinfer.engine.image_ahead import Processed
from batchinfer.launch.local import run_local

pytestmark = pytest.mark.engine

TEXTS = ["describe this picture", "what colour is the square", "label this image as red green or blue"]
GOOD = 50  # rows with a readable image (as issue 47 asks)
DISTINCT = 16  # distinct pictures among them


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny VLM, built once for this module."""
    return tiny_vlm.build(tmp_path_factory.mktemp("tiny-vlm"))


@pytest.fixture(scope="module")
def vlm_engine(vlm_path: Path) -> Any:
    """The tiny VLM on one engine for this module."""
    from batchinfer.engine.vllm_engine import Engine

    eng = Engine(compose(model_overrides(vlm_path)))
    yield eng
    eng.close()


def write_image_corpus(d: Path) -> list[dict[str, Any]]:
    """GOOD rows over DISTINCT pictures (relative paths; one picture also under a second name),
    then a missing, a zero-byte, a corrupt and a too big image."""
    for i in range(DISTINCT):
        tiny_vlm.write_image(d / "img" / f"{i}.png", i)
    shutil.copy(d / "img" / "3.png", d / "img" / "copy-of-3.png")
    rows = [{"id": f"r{i}", "text": TEXTS[i % 3], "image": f"img/{i % DISTINCT}.png"} for i in range(GOOD)]
    # the last good row: r3's picture under another name, with r3's text (the others differ in one or both)
    rows[GOOD - 1].update(image="img/copy-of-3.png", text=rows[3]["text"])
    (d / "img" / "empty.png").write_bytes(b"")
    (d / "img" / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"not really a png" * 8)
    tiny_vlm.write_image(d / "img" / "huge.png", 0, size=400)  # 160,000 pixels: over the run's limit
    rows += [
        {"id": "missing", "text": TEXTS[0], "image": "img/nope.png"},
        {"id": "empty", "text": TEXTS[0], "image": "img/empty.png"},
        {"id": "corrupt", "text": TEXTS[0], "image": "img/corrupt.png"},
        {"id": "huge", "text": TEXTS[0], "image": "img/huge.png"},
    ]
    with open(d / "corpus.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return rows


def vllm_chat(engine: Any, d: Path, rows: list[dict[str, Any]], max_tokens: int) -> list[Any]:
    """vLLM's own answers: LLM.chat with each row's image as an image_pil part, greedy."""
    from PIL import Image
    from vllm import SamplingParams

    chats = [
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_pil", "image_pil": Image.open(d / r["image"]).convert("RGB")},
                    {"type": "text", "text": r["text"]},
                ],
            }
        ]
        for r in rows
    ]
    return engine.llm.chat(chats, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)


def test_image_rows_equal_vllm_own_chat_and_bad_images_are_error_rows(
    tmp_path: Path, vlm_path: Path, vlm_engine: Any
) -> None:
    rows = write_image_corpus(tmp_path)
    added: list[Any] = []
    add = vlm_engine.add

    def spy(rid: str, ids: list[int], params: Any, **kw: Any) -> None:
        image = kw.get("image")
        added.append(image.digest if isinstance(image, Processed) else image)  # processed ahead: all of them
        add(rid, ids, params, **kw)

    vlm_engine.add = spy
    try:
        cfg = compose(
            [
                f"input.path={tmp_path / 'corpus.jsonl'}",
                f"output.dir={tmp_path / 'run'}",
                "input.id_column=id",
                "prompt.image_column=image",
                "prompt.image_max_pixels=100000",
                "sampling.max_tokens=6",
                *model_overrides(vlm_path),
            ]
        )
        out = read_output(run_local(cfg, engine=vlm_engine).path)
    finally:
        vlm_engine.add = add
    assert [r["id"] for r in out] == [r["id"] for r in rows]
    good, bad = out[:GOOD], {r["id"]: r for r in out[GOOD:]}
    expected = vllm_chat(vlm_engine, tmp_path, rows[:GOOD], 6)
    assert all(r["error"] is None for r in good), [r["error"] for r in good if r["error"]]
    assert [r["text"] for r in good] == [o.outputs[0].text for o in expected]
    assert [r["prompt_tokens"] for r in good] == [len(o.prompt_token_ids) for o in expected]
    assert good[0]["prompt_tokens"] > tiny_vlm.IMAGE_SEQ_LEN  # the image's tokens were expanded
    # The same bytes under another path with the same text: one request (the last good row took r3's answer).
    assert len(added) == len({(r["image"].replace("copy-of-", ""), r["text"]) for r in rows[:GOOD]}) < GOOD
    assert all(isinstance(a, str) for a in added)  # every image reached add processed (image_ahead.py)
    assert good[GOOD - 1]["text"] == good[3]["text"]
    for id_, name, what in [
        ("missing", "nope.png", "no such file"),
        ("empty", "empty.png", "empty (0 bytes)"),
        ("corrupt", "corrupt.png", "does not decode"),
        ("huge", "huge.png", "over prompt.image_max_pixels=100,000"),
    ]:
        err = bad[id_]["error"]
        assert err["kind"] == "image" and name in err["message"] and what in err["message"], err
        assert err["message"].startswith(f"row {bad[id_]['row']}: "), err


def test_openai_batch_image_url_parts_run_as_vllm_own_chat(tmp_path: Path, vlm_path: Path, vlm_engine: Any) -> None:
    """image_url parts (a data URL, a relative file) run; the answer is LLM.chat's with that image."""
    import base64

    from support.openai_batch import request, run_batch

    for i in range(2):
        tiny_vlm.write_image(tmp_path / f"{i}.png", i + 4)
    data = "data:image/png;base64," + base64.b64encode((tmp_path / "1.png").read_bytes()).decode()

    def body(url: str, text: str) -> dict[str, Any]:
        parts = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]
        return {"messages": [{"role": "user", "content": parts}]}

    lines = request("file", body("0.png", TEXTS[1])) + request("data", body(data, TEXTS[2]))
    out = {o["custom_id"]: o for o in run_batch(tmp_path, vlm_path, vlm_engine, lines)}
    expected = vllm_chat(
        vlm_engine, tmp_path, [{"image": "0.png", "text": TEXTS[1]}, {"image": "1.png", "text": TEXTS[2]}], 5
    )
    for cid, want in zip(("file", "data"), expected, strict=True):
        assert out[cid]["error"] is None, out[cid]
        usage = out[cid]["response"]["body"]["usage"]
        assert out[cid]["response"]["body"]["choices"][0]["message"]["content"] == want.outputs[0].text
        assert usage["prompt_tokens"] == len(want.prompt_token_ids)


KILL_ROWS = 160  # 2 shards of 80 image rows, a part every 16


@pytest.mark.kill
def test_sigkill_during_an_image_shard_then_the_same_run(
    tmp_path: Path, vlm_path: Path, vlm_engine: Any, clean_shm: None
) -> None:
    """A real `batchinfer run` (its own engine) SIGKILLed between engine steps of the first image
    shard, then the same run in this process: every row once, as an uninterrupted run answers it,
    the parts committed before the kill byte for byte as they were, only the other rows redone."""
    for i in range(23):
        tiny_vlm.write_image(tmp_path / "img" / f"{i}.png", i)
    rows = [{"id": f"r{i}", "text": TEXTS[i % 3], "image": f"img/{i % 23}.png"} for i in range(KILL_ROWS)]
    with open(tmp_path / "corpus.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    base = [
        f"input.path={tmp_path / 'corpus.jsonl'}",
        "input.id_column=id",
        "prompt.image_column=image",
        "sampling.max_tokens=24",
        "sharding.num_shards=2",
        "output.commit_every_rows=16",
        "output.format=jsonl",  # committed rows compared as the bytes of their lines
        *model_overrides(vlm_path),
    ]
    clean = read_output(run_local(compose([*base, f"output.dir={tmp_path}/clean"]), engine=vlm_engine).path)
    assert [r["id"] for r in clean] == [r["id"] for r in rows] and all(r["error"] is None for r in clean)

    out = tmp_path / "killed"
    res = run_cli(["run", *base, f"output.dir={out}"], env={"BATCHINFER_FAULT": "in-generate:60"})
    assert res.returncode == -signal.SIGKILL, res.stderr[-3000:]
    assert group_alive(res.pid) == []  # the engine's processes died with it
    committed = committed_parts_are_whole(out)
    assert 0 < committed < KILL_ROWS // 2, committed  # killed inside the first shard, after some parts
    assert not list(out.glob("shards/*/DONE.json"))  # no shard finished
    before = committed_rows(out)

    with recorded_commits() as redone:
        run = run_local(compose([*base, f"output.dir={out}"]), engine=vlm_engine)
    again = read_output(run.path)
    assert [r["row"] for r in again] == list(range(KILL_ROWS)) and [r["id"] for r in again] == [r["id"] for r in rows]
    assert project(again) == project(clean) and all(r["error"] is None for r in again)
    assert_only_missing_rows_redone(out, before, redone, KILL_ROWS)  # committed lines unchanged, the rest once
