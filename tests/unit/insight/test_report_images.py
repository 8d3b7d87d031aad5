"""`report` counts a run's images: rows with an image, image error rows, distinct images by content
digest (one picture under two paths, or as a file and a data URL, is one image)."""

from __future__ import annotations

import base64
import shutil
from pathlib import Path

from support import tiny_vlm
from support.corpus import write_rows
from support.fake_engine import FakeEngine, fake_overrides

from batchinfer.config.compose import compose
from batchinfer.config.schema import to_config
from batchinfer.engine.vllm_engine import model_key
from batchinfer.insight.report import build_report, format_report
from batchinfer.launch.local import run_local


def test_report_counts_rows_with_images_errors_and_distinct_images(tmp_path: Path) -> None:
    img = tmp_path / "img"
    for i in range(3):
        tiny_vlm.write_image(img / f"{i}.png", i, size=32)
    shutil.copy(img / "1.png", img / "again.png")
    (img / "bad.png").write_bytes(b"GIF89a broken")
    data = "data:image/png;base64," + base64.b64encode((img / "0.png").read_bytes()).decode()
    images = ["img/0.png", "img/1.png", "img/2.png", f"file://{img / 'again.png'}", "img/missing.png", "img/bad.png"]
    rows = [{"id": f"r{i}", "text": "what colour", "image": v} for i, v in enumerate([*images, data])]
    write_rows(tmp_path / "c.jsonl", rows)
    cfg = compose(fake_overrides(tmp_path, tmp_path / "c.jsonl", "input.id_column=id", "prompt.image_column=image"))
    eng = FakeEngine()
    eng.key = model_key(to_config(cfg))  # type: ignore[attr-defined]
    run = run_local(cfg, engine=eng)
    rep = build_report(run)
    assert rep["images"] == {
        "column": "image",
        "rows": 7,
        "rows_with_image": 7,
        "image_error_rows": 2,  # missing.png, bad.png
        "distinct_images": 3,  # again.png is 1.png; the data URL is 0.png
        "files": 6,
        "undigested": 0,
    }
    assert (
        "7 of 7 committed rows have an image (column `image`); 2 are error rows of kind image (missing, "
        "unreadable, corrupt or too large); 3 distinct images by content digest (6 image files named)."
    ) in format_report(rep, [])


def test_a_run_without_images_reports_none(tmp_path: Path) -> None:
    write_rows(tmp_path / "c.jsonl", [{"id": "a", "text": "x"}])
    cfg = compose(fake_overrides(tmp_path, tmp_path / "c.jsonl", "input.id_column=id"))
    eng = FakeEngine()
    eng.key = model_key(to_config(cfg))  # type: ignore[attr-defined]
    rep = build_report(run_local(cfg, engine=eng))
    assert rep["images"] is None and "## Images" not in format_report(rep, [])


def test_an_image_column_of_mixed_types_is_recorded_and_counted_by_its_paths(tmp_path: Path) -> None:
    # an int among the paths: `datasets` keeps the column as JSON text; images.json and report read
    # the paths the worker reads ("img/0.png", not the JSON text '"img/0.png"')
    from batchinfer.rundir.image_files import read_record

    img = tmp_path / "img"
    for i in range(2):
        tiny_vlm.write_image(img / f"{i}.png", i, size=32)
    images = ["img/0.png", 7, {"path": "img/1.png"}, "img/1.png"]
    write_rows(tmp_path / "c.jsonl", [{"id": i, "text": "what colour", "image": v} for i, v in enumerate(images)])
    cfg = compose(fake_overrides(tmp_path, tmp_path / "c.jsonl", "input.id_column=id", "prompt.image_column=image"))
    eng = FakeEngine()
    eng.key = model_key(to_config(cfg))  # type: ignore[attr-defined]
    run = run_local(cfg, engine=eng)
    files = read_record(run.path)
    assert [(f.path, f.digest is not None) for f in files or []] == [
        (str(img / "0.png"), True),
        (str(img / "1.png"), True),
    ]
    rep = build_report(run)
    assert rep["images"] is not None
    assert (rep["images"]["image_error_rows"], rep["images"]["distinct_images"], rep["images"]["files"]) == (1, 2, 2)
    assert rep["images"]["undigested"] == 0
