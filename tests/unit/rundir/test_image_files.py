"""The image files a run's rows name are part of what the run was prepared from: a reopen or resume
after one changed is refused naming it, a touch is not a change, and output.reuse does not reuse
an answer made from an image whose bytes changed (it keys on the image's content digest)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from support import tiny_vlm
from support.corpus import read_output, write_rows
from support.fake_engine import FakeEngine, fake_overrides, keyed

from batchinfer.config.compose import compose
from batchinfer.errors import RunDirError
from batchinfer.launch.local import run_shards
from batchinfer.rundir import image_files
from batchinfer.rundir.merge import merge
from batchinfer.rundir.prepare import prepare
from batchinfer.rundir.schema import REUSED_COLUMN
from batchinfer.rundir.store import RunDir


def image_rows(d: Path, n: int = 8) -> list[dict[str, Any]]:
    """n rows over n pictures: relative paths, a file:// URL, and one image missing."""
    for i in range(n):
        tiny_vlm.write_image(d / "img" / f"{i}.png", i, size=32)
    rows = [{"id": f"r{i}", "text": "what colour", "image": f"img/{i}.png"} for i in range(n)]
    rows[1]["image"] = f"file://{d / 'img' / '1.png'}"
    rows.append({"id": "gone", "text": "what colour", "image": "img/missing.png"})
    write_rows(d / "c.jsonl", rows)
    return rows


def overrides(d: Path, name: str = "run", *extra: str) -> list[str]:
    ov = fake_overrides(d, d / "c.jsonl", "input.id_column=id", "prompt.image_column=image", *extra)
    return [o if not o.startswith("output.dir=") else f"output.dir={d / name}" for o in ov]


def rewrite(path: Path, index: int) -> None:
    """Another picture at the same path, written a second later."""
    st = path.stat()
    tiny_vlm.write_image(path, index, size=32)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))


def test_prepare_records_every_image_file_with_its_digest(tmp_path: Path) -> None:
    image_rows(tmp_path)
    run = prepare(compose(overrides(tmp_path)))
    files = image_files.read_record(run.path)
    assert files is not None
    by_path = {f.path: f for f in files}
    assert sorted(by_path) == sorted(
        [str(tmp_path / "img" / f"{i}.png") for i in range(8)] + [str(tmp_path / "img" / "missing.png")]
    )
    from batchinfer.requests.images import image_digest

    assert by_path[str(tmp_path / "img" / "1.png")].digest == image_digest((tmp_path / "img" / "1.png").read_bytes())
    assert by_path[str(tmp_path / "img" / "missing.png")].digest is None


def test_a_run_without_image_files_has_no_record(tmp_path: Path) -> None:
    write_rows(tmp_path / "c.jsonl", [{"id": "a", "text": "x"}])
    run = prepare(compose(fake_overrides(tmp_path, tmp_path / "c.jsonl", "input.id_column=id")))
    assert not (run.path / image_files.RECORD).exists()


def test_a_changed_image_is_refused_on_reopen_and_resume_naming_it(tmp_path: Path) -> None:
    from batchinfer.launch.submit import resume

    image_rows(tmp_path)
    run = prepare(compose(overrides(tmp_path, "run", "sharding.num_shards=2")))
    run_shards(run, [0], engine=keyed(FakeEngine(), run))
    # touched (the same bytes, another mtime): no change, and the new stat is recorded
    os.utime(tmp_path / "img" / "3.png", ns=(1, 10**18))
    prepare(compose(overrides(tmp_path, "run", "sharding.num_shards=2")))
    recorded = {f.path: f for f in image_files.read_record(run.path) or []}
    assert recorded[str(tmp_path / "img" / "3.png")].mtime_ns == 10**18
    rewrite(tmp_path / "img" / "3.png", 5)
    with pytest.raises(RunDirError) as e:
        prepare(compose(overrides(tmp_path, "run", "sharding.num_shards=2")))
    assert f"1 image file the run's rows name changed since it was prepared ({run.path / 'images.json'})" in str(
        e.value
    )
    assert f"{tmp_path / 'img' / '3.png'} (contents changed" in str(e.value)
    with pytest.raises(RunDirError, match="3.png \\(contents changed"):
        resume(str(run.path), [], force=True, dry_run=True)
    # many: the first few named, the rest counted; a file gone and one that appeared say so
    for i in (0, 2, 4, 6, 7):
        rewrite(tmp_path / "img" / f"{i}.png", i + 1)
    (tmp_path / "img" / "1.png").unlink()
    tiny_vlm.write_image(tmp_path / "img" / "missing.png", 0)
    with pytest.raises(RunDirError) as e:
        resume(str(run.path), [], force=True, dry_run=True)
    msg = str(e.value)
    assert "8 image files the run's rows name changed" in msg and "; and 3 more." in msg
    assert f"{tmp_path / 'img' / '1.png'} (gone or unreadable)" in msg
    assert f"{tmp_path / 'img' / 'missing.png'} (unreadable at prepare, there now)" in image_files.image_changes(
        run.path
    )


def test_reuse_does_not_reuse_an_answer_for_a_changed_image(tmp_path: Path) -> None:
    image_rows(tmp_path)
    first = prepare(compose(overrides(tmp_path, "first")))
    run_shards(first, [s.index for s in first.shards()], engine=keyed(FakeEngine(), first))
    merge(first)
    before = {r["id"]: r["text"] for r in read_output(first.path)}
    rewrite(tmp_path / "img" / "2.png", 11)  # the same path, a picture no row had
    shutil.copy(tmp_path / "img" / "5.png", tmp_path / "img" / "5-copy.png")  # nothing reads it: no matter
    second = prepare(compose(overrides(tmp_path, "second", f"output.reuse={first.path}")))
    eng = FakeEngine()
    run_shards(second, [s.index for s in second.shards()], engine=keyed(eng, second))
    merge(second)
    out = {r["id"]: r for r in read_output(RunDir(second.path).path)}
    assert [r for r in out if out[r][REUSED_COLUMN]] == [f"r{i}" for i in range(8) if i != 2]
    assert len(eng.added) == 1 and out["r2"]["text"] != before["r2"]
    assert out["r4"]["text"] == before["r4"]


def test_prepare_digests_only_regular_files_within_the_byte_limit(tmp_path: Path) -> None:
    # a FIFO is never opened (it waited for a writer for ever), a device never read (/dev/zero
    # filled memory), a file over prompt.image_max_bytes not read: each has no digest, its row an
    # error row of kind image naming the file and what it is
    import threading

    image_rows(tmp_path, 2)
    (tmp_path / "img" / "big.png").write_bytes(b"\x89PNG" + bytes(5000))
    os.mkfifo(tmp_path / "img" / "pipe.png")
    # a writer that opens the FIFO (waiting for a reader) and closes it: code that opens it reads
    # nothing and digests the empty bytes, where it should have left it unopened
    writer = threading.Thread(target=lambda: open(tmp_path / "img" / "pipe.png", "wb").close(), daemon=True)
    writer.start()
    extra = [
        {"id": "pipe", "text": "what colour", "image": "img/pipe.png"},
        {"id": "null", "text": "what colour", "image": "/dev/null"},
        {"id": "big", "text": "what colour", "image": "img/big.png"},
    ]
    rows = [*image_rows(tmp_path, 2), *extra]
    write_rows(tmp_path / "c.jsonl", rows)
    try:
        run = prepare(compose(overrides(tmp_path, "run", "prompt.image_max_bytes=4096")))
        recorded = {f.path: f.digest for f in image_files.read_record(run.path) or []}
        assert recorded[str(tmp_path / "img" / "0.png")] is not None
        for path in (tmp_path / "img" / "pipe.png", Path("/dev/null"), tmp_path / "img" / "big.png"):
            assert recorded[str(path)] is None, path
        run_shards(run, [s.index for s in run.shards()], engine=keyed(FakeEngine(), run))
        merge(run)
        out = {r["id"]: r["error"] for r in read_output(run.path)}
        assert out["r0"] is None
        assert out["pipe"]["kind"] == "image" and f"{tmp_path / 'img' / 'pipe.png'} is a FIFO" in out["pipe"]["message"]
        assert out["null"]["kind"] == "image" and "/dev/null is a character device" in out["null"]["message"]
        assert out["big"]["kind"] == "image" and "over prompt.image_max_bytes=4,096" in out["big"]["message"]
    finally:
        if writer.is_alive():  # the fixed code never opened the FIFO: let its writer go
            os.close(os.open(tmp_path / "img" / "pipe.png", os.O_RDONLY | os.O_NONBLOCK))
        writer.join()
