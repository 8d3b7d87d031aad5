"""A redo pass over image rows reads the images the rows name: paths relative to the run's input
file, not to the pass's folder (DIR/passes/N, where its selection of rows is)."""

from __future__ import annotations

from pathlib import Path

from support import tiny_vlm
from support.corpus import read_output, write_rows
from support.fake_engine import FakeEngine, fake_overrides, keyed

from batchinfer.config.compose import compose
from batchinfer.launch.local import run_local
from batchinfer.launch.redo import redo
from batchinfer.requests.images import image_digest


def test_a_redo_of_image_rows_reads_their_images_relative_to_the_input(tmp_path: Path) -> None:
    for i in range(3):
        tiny_vlm.write_image(tmp_path / "img" / f"{i}.png", i, size=32)
    rows = [{"id": f"r{i}", "text": "what colour", "image": f"img/{i}.png"} for i in range(4)]  # img/3.png missing
    write_rows(tmp_path / "c.jsonl", rows)
    cfg = compose(fake_overrides(tmp_path, tmp_path / "c.jsonl", "input.id_column=id", "prompt.image_column=image"))
    eng = FakeEngine()
    run = run_local(cfg, engine=keyed(eng, _prepared(cfg)))
    before = {r["id"]: r for r in read_output(run.path)}
    assert before["r3"]["error"]["kind"] == "image" and "img/3.png: no such file" in before["r3"]["error"]["message"]
    tiny_vlm.write_image(tmp_path / "img" / "3.png", 3, size=32)  # the picture is put there: redo the row
    redo(str(run.path), "error is not null", [], engine=keyed(FakeEngine(), run))
    after = {r["id"]: r for r in read_output(run.path)}
    assert after["r3"]["error"] is None and after["r3"]["pass"] == 1, after["r3"]["error"]
    ids = eng.encode([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour"}]}])
    digest = image_digest((tmp_path / "img" / "3.png").read_bytes())
    assert after["r3"]["text"] == FakeEngine.answer(ids, None, digest)
    assert [after[f"r{i}"]["text"] for i in range(3)] == [before[f"r{i}"]["text"] for i in range(3)]


def _prepared(cfg: object) -> object:
    from batchinfer.rundir.prepare import prepare

    return prepare(cfg)  # type: ignore[arg-type]


def test_a_redo_of_an_image_column_of_mixed_types_answers_its_rows_again(tmp_path: Path) -> None:
    # an int among the paths: `datasets` keeps the column as JSON text ("img/0.png" with its quotes),
    # the worker's rows hold it decoded; the redo's selection held the JSON text (no such file)
    for i in range(2):
        tiny_vlm.write_image(tmp_path / "img" / f"{i}.png", i, size=32)
    images = ["img/0.png", 7, ["img/0.png", "img/1.png"], {"path": "img/1.png"}]
    write_rows(tmp_path / "c.jsonl", [{"id": i, "text": "what colour", "image": v} for i, v in enumerate(images)])
    cfg = compose(fake_overrides(tmp_path, tmp_path / "c.jsonl", "input.id_column=id", "prompt.image_column=image"))
    run = run_local(cfg, engine=keyed(FakeEngine(), _prepared(cfg)))
    before = {r["id"]: r for r in read_output(run.path)}
    assert [before[i]["error"] is None for i in range(4)] == [True, False, False, True], before
    redo(str(run.path), "id < 4", [], engine=keyed(FakeEngine(), run))
    after = {r["id"]: r for r in read_output(run.path)}
    assert [after[i]["pass"] for i in range(4)] == [1, 1, 1, 1]
    assert after[0]["error"] is None and after[3]["error"] is None, (after[0]["error"], after[3]["error"])
    assert [after[i]["text"] for i in (0, 3)] == [before[i]["text"] for i in (0, 3)]
    assert after[1]["error"]["kind"] == after[2]["error"]["kind"] == "image"


def test_redo_refuses_an_image_file_changed_since_prepare_that_rows_it_keeps_name(tmp_path: Path) -> None:
    import os
    import shutil

    import pytest

    from batchinfer.errors import RunDirError
    from batchinfer.rundir.image_files import read_record

    img = tmp_path / "img"
    for i in range(2):
        tiny_vlm.write_image(img / f"{i}.png", i, size=32)
    rows = [{"id": i, "text": "what colour", "image": v} for i, v in enumerate(["img/0.png", "img/0.png", "img/1.png"])]
    write_rows(tmp_path / "c.jsonl", rows)
    cfg = compose(fake_overrides(tmp_path, tmp_path / "c.jsonl", "input.id_column=id", "prompt.image_column=image"))
    run = run_local(cfg, engine=keyed(FakeEngine(), _prepared(cfg)))
    before = {r["id"]: r for r in read_output(run.path)}
    mtime = (img / "0.png").stat().st_mtime_ns
    shutil.copy(img / "1.png", img / "0.png")  # another picture under 0.png
    os.utime(img / "0.png", ns=(mtime + 10**9, mtime + 10**9))
    for where in ("id == 0", "id == 2"):  # row 1 (kept) was answered from the old 0.png
        with pytest.raises(RunDirError, match=r"1 image file rows this redo keeps name changed") as e:
            redo(str(run.path), where, [], engine=keyed(FakeEngine(), run))
        assert f"{img / '0.png'} (contents changed" in str(e.value)
    assert not (run.path / "passes").exists() or not any((run.path / "passes").iterdir())
    # every row naming it redone: they are answered from the new bytes, and the record follows
    redo(str(run.path), "id < 2", [], engine=keyed(FakeEngine(), run))
    after = {r["id"]: r for r in read_output(run.path)}
    assert after[0]["text"] == after[1]["text"] == before[2]["text"] != before[0]["text"]
    digest = image_digest((img / "0.png").read_bytes())
    assert {f.path: f.digest for f in read_record(run.path) or []}[str(img / "0.png")] == digest


def test_report_counts_a_redos_image_rows_as_merged(tmp_path: Path) -> None:
    from batchinfer.insight.report import build_report

    for i in range(2):
        tiny_vlm.write_image(tmp_path / "img" / f"{i}.png", i, size=32)
    rows = [{"id": f"r{i}", "text": "what colour", "image": f"img/{i}.png"} for i in range(3)]  # img/2.png missing
    write_rows(tmp_path / "c.jsonl", rows)
    cfg = compose(fake_overrides(tmp_path, tmp_path / "c.jsonl", "input.id_column=id", "prompt.image_column=image"))
    run = run_local(cfg, engine=keyed(FakeEngine(), _prepared(cfg)))
    assert build_report(run)["images"]["image_error_rows"] == 1  # type: ignore[index]
    tiny_vlm.write_image(tmp_path / "img" / "2.png", 2, size=32)
    redo(str(run.path), "error is not null", [], engine=keyed(FakeEngine(), run))
    counts = build_report(run)["images"]
    assert counts is not None
    assert (counts["rows"], counts["image_error_rows"], counts["distinct_images"]) == (3, 0, 3), counts


def _three_rows(tmp_path: Path, names: list[str]) -> tuple[Path, object]:
    """A run over rows naming these files (img/NAME), on the fake engine."""
    rows = [{"id": i, "text": "what colour", "image": f"img/{n}"} for i, n in enumerate(names)]
    write_rows(tmp_path / "c.jsonl", rows)
    cfg = compose(fake_overrides(tmp_path, tmp_path / "c.jsonl", "input.id_column=id", "prompt.image_column=image"))
    return tmp_path / "img", run_local(cfg, engine=keyed(FakeEngine(), _prepared(cfg)))


def test_a_failed_redo_of_the_rows_naming_a_changed_image_leaves_its_record_as_it_was(tmp_path: Path) -> None:
    # attack H1: the check recorded a.png's new stat before the pass was made; the redo refused,
    # a redo of other rows then went through, row 0's answer from the old a.png kept silently
    import os
    import shutil

    import pytest

    from batchinfer.errors import BatchinferError, RunDirError
    from batchinfer.rundir.image_files import read_record

    tiny_vlm.write_image(tmp_path / "img" / "a.png", 0, size=32)
    tiny_vlm.write_image(tmp_path / "img" / "b.png", 1, size=32)
    img, run = _three_rows(tmp_path, ["a.png", "b.png", "b.png"])
    before = read_record(run.path)  # type: ignore[attr-defined]
    mtime = (img / "a.png").stat().st_mtime_ns
    shutil.copy(img / "b.png", img / "a.png")
    os.utime(img / "a.png", ns=(mtime + 10**9, mtime + 10**9))
    with pytest.raises(BatchinferError, match="temperature"):
        redo(str(run.path), "id == 0", ["sampling.temperature=-3"], engine=keyed(FakeEngine(), run))
    assert read_record(run.path) == before  # type: ignore[attr-defined]
    with pytest.raises(RunDirError, match=r"1 image file rows this redo keeps name changed") as e:
        redo(str(run.path), "id == 1", [], engine=keyed(FakeEngine(), run))
    assert f"{img / 'a.png'} (contents changed" in str(e.value)
    # the redo of row 0 made and merged: the record holds the new bytes, other rows may be redone
    redo(str(run.path), "id == 0", [], engine=keyed(FakeEngine(), run))
    digest = image_digest((img / "a.png").read_bytes())
    assert {f.path: f.digest for f in read_record(run.path) or []}[str(img / "a.png")] == digest  # type: ignore[attr-defined]
    redo(str(run.path), "id == 1", [], engine=keyed(FakeEngine(), run))
    assert [r["pass"] for r in read_output(run.path)] == [1, 2, 0]  # type: ignore[attr-defined]


def test_a_stopped_redo_pass_keeps_the_changed_image_refused_for_other_rows(tmp_path: Path) -> None:
    # the pass made, its run stopped before merge: its rows are not answered from the new bytes yet
    import os
    import shutil

    import pytest

    from batchinfer.errors import RunDirError
    from batchinfer.launch import redo as redo_mod
    from batchinfer.rundir import passes

    tiny_vlm.write_image(tmp_path / "img" / "a.png", 0, size=32)
    tiny_vlm.write_image(tmp_path / "img" / "b.png", 1, size=32)
    img, run = _three_rows(tmp_path, ["a.png", "b.png", "b.png"])
    mtime = (img / "a.png").stat().st_mtime_ns
    shutil.copy(img / "b.png", img / "a.png")
    os.utime(img / "a.png", ns=(mtime + 10**9, mtime + 10**9))
    made = redo_mod.new_pass(run, "id == 0", [])  # type: ignore[arg-type]
    assert made is not None and not passes.is_finished(made.path)
    with pytest.raises(RunDirError, match=r"a\.png \(contents changed"):
        redo_mod.new_pass(run, "id == 1", [])  # type: ignore[arg-type]


def test_a_kept_image_error_row_does_not_refuse_a_redo_once_its_file_is_there(tmp_path: Path) -> None:
    # attack M3: img/m.png missing at prepare (row 1 an error row), put there later; a redo of
    # another row was refused "unreadable at prepare, there now" though row 1 read no bytes
    tiny_vlm.write_image(tmp_path / "img" / "a.png", 0, size=32)
    img, run = _three_rows(tmp_path, ["a.png", "m.png", "a.png"])
    before = {r["id"]: r for r in read_output(run.path)}  # type: ignore[attr-defined]
    assert before[1]["error"]["kind"] == "image"
    tiny_vlm.write_image(img / "m.png", 2, size=32)
    redo(str(run.path), "id == 0", ["sampling.seed=5"], engine=keyed(FakeEngine(), run))
    after = {r["id"]: r for r in read_output(run.path)}  # type: ignore[attr-defined]
    assert (after[0]["pass"], after[1]["pass"], after[1]["error"]["kind"]) == (1, 0, "image")
    redo(str(run.path), "error is not null", [], engine=keyed(FakeEngine(), run))  # the row answered now
    assert {r["id"]: r for r in read_output(run.path)}[1]["error"] is None  # type: ignore[attr-defined]
