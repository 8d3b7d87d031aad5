"""A Parquet or Arrow corpus is referenced in place, not copied: DIR/input holds a manifest, shards
map to row ranges of the files, the fingerprint comes from footers, and a task refuses a file that
changed after prepare (issue 16). No engine."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest
from support.runs import fake_model_dir

from batchinfer.config.compose import compose
from batchinfer.errors import InputError, RunDirError
from batchinfer.inputs import reference
from batchinfer.inputs.convert import convert_input, open_input
from batchinfer.inputs.fingerprint import file_fingerprint
from batchinfer.inputs.paths import input_files, is_saved_dataset
from batchinfer.inputs.preview import peek
from batchinfer.rundir.prepare import prepare

FILES, PER_FILE, GROUP = 3, 1000, 300  # row groups of 300, 300, 300, 100 in each file


def row(i: int) -> dict[str, Any]:
    """Each row its own content: a swapped or shifted row cannot pass."""
    return {"id": f"r{i:05d}", "text": f"text of row {i}", "n": i, "meta": {"k": 2 * i, "tag": f"t{i % 7}"}}


def write_parquet(folder: Path, files: int = FILES, per_file: int = PER_FILE, edit: Any = None) -> list[Path]:
    """files Parquet files of per_file consecutive rows each, in row groups of GROUP rows."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for f in range(files):
        rows = [row(i) for i in range(f * per_file, (f + 1) * per_file)]
        if edit is not None:
            rows = [edit(r) for r in rows]
        path = folder / f"part-{f}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=GROUP)
        paths.append(path)
    return paths


def prepared(tmp_path: Path, path: str, *extra: str) -> Any:
    ov = [
        f"input.path={path}",
        "input.id_column=id",
        f"model.path={fake_model_dir(tmp_path)}",
        f"output.dir={tmp_path / 'run'}",
        *extra,
    ]
    return prepare(compose(ov))


def tree_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def test_parquet_corpus_is_referenced_not_copied(tmp_path: Path) -> None:
    write_parquet(tmp_path / "corpus")
    run = prepared(
        tmp_path, str(tmp_path / "corpus" / "*.parquet"), "sharding.rows_per_shard=700", "input.columns=[meta.k]"
    )
    assert [f.name for f in run.input_dir.iterdir()] == [reference.MANIFEST]
    assert tree_bytes(run.input_dir) < 8192
    assert not [f for f in run.path.rglob("*") if f.suffix in (".arrow", ".parquet")]
    manifest = json.loads((run.input_dir / reference.MANIFEST).read_text())
    assert [rec["pieces"] for rec in manifest["files"]] == [[300, 300, 300, 100]] * FILES
    assert run.run["input"]["rows"] == 3000 and run.run["input"]["method"] == "footers"
    # Shards of 700 cross row groups (every 300) and files (every 1000): each row comes back as written.
    shards = list(run.shards())
    assert [(s.start, s.stop) for s in shards] == [(0, 700), (700, 1400), (1400, 2100), (2100, 2800), (2800, 3000)]
    ds = open_input(run.input_dir)
    assert len(ds) == 3000 and ds.column_names == ["id", "text", "n", "meta"]
    for s in shards:
        assert ds.select(list(range(s.start, s.stop))).to_list() == [row(i) for i in range(s.start, s.stop)]
    # Any order, repeats, across files: as asked.
    picks = [2999, 0, 1000, 299, 300, 999, 1000, 5, 2100]
    assert ds.select(picks).to_list() == [row(i) for i in picks]
    # Windows walking forward through a row group go on from the cursor; a step back starts again.
    for start in (0, 50, 100, 950, 1020, 40):
        assert ds.select(list(range(start, start + 30))).to_list() == [row(i) for i in range(start, start + 30)]
    assert ds[1234] == row(1234) and ds.select([]).to_list() == []
    assert ds.data.column("id").to_pylist() == [row(i)["id"] for i in range(3000)]
    assert ds.data.schema.field("meta").type.field("k").type == pa.int64()
    with pytest.raises(IndexError):
        ds.select([3000])
    # `plan` counts the rows from the footers and reads its sample where the run will.
    assert peek(input_files(str(tmp_path / "corpus" / "*.parquet")), "parquet", 5) == (
        3000,
        [row(i) for i in (0, 600, 1200, 1800, 2400)],
    )


def test_fingerprint_keeps_a_touch_and_sees_a_rewrite(tmp_path: Path) -> None:
    paths = write_parquet(tmp_path / "corpus")
    pattern = str(tmp_path / "corpus" / "*.parquet")
    before = file_fingerprint(paths, None, "parquet")
    run = prepared(tmp_path, pattern)
    assert run.run["input"]["fingerprint"] == before["fingerprint"]
    st = paths[1].stat()
    os.utime(paths[1], ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    touched = file_fingerprint(paths, None, "parquet")
    assert touched["files"] != before["files"] and touched["fingerprint"] == before["fingerprint"]
    assert prepared(tmp_path, pattern).run["fingerprint"] == run.run["fingerprint"]  # reopens
    # The same rows but one text edited: a different file, a different run.
    write_parquet(tmp_path / "corpus", edit=lambda r: dict(r, text="edited") if r["n"] == 1500 else r)
    assert file_fingerprint(paths, None, "parquet")["fingerprint"] != before["fingerprint"]
    with pytest.raises(RunDirError, match=r"input.fingerprint"):
        prepared(tmp_path, pattern)


def test_a_task_refuses_a_file_changed_after_prepare(tmp_path: Path) -> None:
    paths = write_parquet(tmp_path / "corpus")
    run = prepared(tmp_path, str(tmp_path / "corpus" / "*.parquet"))
    st = paths[2].stat()
    pq.write_table(pa.Table.from_pylist([dict(row(i), text="new") for i in range(2000, 3000)]), paths[2])
    ds = open_input(run.input_dir)
    assert ds.select([0, 1999]).to_list() == [row(0), row(1999)]  # files 0 and 1 are as they were
    with pytest.raises(InputError, match=rf"refers to {paths[2]} in place, and it changed since the run was prepared"):
        ds.select([2000])
    # Only the time changed: refused too, with the command that puts the time back; then it reads.
    write_parquet(tmp_path / "corpus")
    os.utime(paths[2], ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    with pytest.raises(InputError, match=r"mtime_ns .* `touch -d @\d+\.\d{9} .*part-2.parquet` puts it back"):
        open_input(run.input_dir).select([2500])
    os.utime(paths[2], ns=(st.st_atime_ns, st.st_mtime_ns))
    assert open_input(run.input_dir).select([2500]).to_list() == [row(2500)]
    paths[0].unlink()
    with pytest.raises(InputError, match=rf"refers to {paths[0]} in place, and it cannot be read here"):
        open_input(run.input_dir).select([10])


def _bytes_read() -> int:
    """Bytes this process has read through read(2) and pread(2), from the page cache or not."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def test_fingerprint_and_prepare_read_footers_not_data(tmp_path: Path) -> None:
    """~24 MB of incompressible text in 3 files: fingerprinting and referencing them read kilobytes,
    and the id check reads the id column only."""
    folder = tmp_path / "big"
    folder.mkdir()
    paths = []
    for f in range(3):
        ids = [f"id-{f}-{i}" for i in range(8000)]
        blobs = [os.urandom(500).hex() for _ in range(8000)]
        paths.append(folder / f"p{f}.parquet")
        pq.write_table(pa.table({"id": ids, "text": blobs}), paths[-1], row_group_size=2000, compression="none")
    size = sum(p.stat().st_size for p in paths)
    assert size > 20 << 20
    # Once on a small corpus first: the modules this imports are read too, and counted.
    convert_input(write_parquet(tmp_path / "small", files=1, per_file=10), "parquet", tmp_path / "warm", None, None)
    start = _bytes_read()
    fp = file_fingerprint(paths, None, "parquet")
    rows = convert_input(paths, "parquet", tmp_path / "input", None, None)
    spent = _bytes_read() - start
    assert rows == 24000 and fp["method"] == "footers" and spent < 256 << 10, spent
    start = _bytes_read()
    convert_input(paths, "parquet", tmp_path / "input-ids", "id", None)
    assert _bytes_read() - start < size // 20
    assert open_input(tmp_path / "input-ids")[23999]["id"] == "id-2-7999"


def test_duplicate_id_in_the_second_file_is_named(tmp_path: Path) -> None:
    write_parquet(tmp_path / "corpus", edit=lambda r: dict(r, id="r00005") if r["n"] == 1234 else r)
    with pytest.raises(InputError, match=r"duplicate id 'r00005' in rows 5 and 1234; ids must be unique"):
        prepared(tmp_path, str(tmp_path / "corpus" / "*.parquet"))
    assert not (tmp_path / "run").exists()


def _table(start: int, stop: int) -> pa.Table:
    return pa.Table.from_pylist([row(i) for i in range(start, stop)])


@pytest.mark.parametrize("kind", ["ipc_file", "ipc_stream", "saved_dataset"])
def test_arrow_files_and_saved_datasets_are_referenced(tmp_path: Path, kind: str) -> None:
    if kind == "saved_dataset":
        import datasets

        datasets.Dataset(_table(0, 1500)).save_to_disk(str(tmp_path / "saved"), num_shards=3)
        path = str(tmp_path / "saved")
    else:
        for f in range(2):
            table = _table(750 * f, 750 * (f + 1))
            dest = tmp_path / f"part-{f}.arrow"
            if kind == "ipc_file":
                feather.write_feather(table, dest, compression="uncompressed", chunksize=200)
            else:
                with pa.ipc.new_stream(str(dest), table.schema) as w:
                    w.write_table(table, max_chunksize=200)
        path = str(tmp_path / "part-*.arrow")
    run = prepared(tmp_path, path, "sharding.num_shards=4")
    assert [f.name for f in run.input_dir.iterdir()] == [reference.MANIFEST]
    ds = open_input(run.input_dir)
    for s in run.shards():
        assert ds.select(list(range(s.start, s.stop))).to_list() == [row(i) for i in range(s.start, s.stop)]
    assert ds.select([1499, 0, 760]).to_list() == [row(1499), row(0), row(760)]
    files = json.loads((run.input_dir / reference.MANIFEST).read_text())["files"]
    assert len(files) == (3 if kind == "saved_dataset" else 2)
    changed = Path(files[-1]["path"])
    os.utime(changed, ns=(changed.stat().st_atime_ns, changed.stat().st_mtime_ns + 1))
    with pytest.raises(InputError, match=rf"refers to {changed} in place, and it changed"):
        open_input(run.input_dir).select([1499])


def test_compressed_arrow_and_mixed_schemas_are_converted(tmp_path: Path) -> None:
    """Where reading in place would not give the rows a conversion gives, or would decompress the
    whole file into memory, the corpus is converted as before."""
    feather.write_feather(_table(0, 500), tmp_path / "lz4.arrow", compression="lz4")
    assert reference.plan_reference([tmp_path / "lz4.arrow"], "arrow") is None
    rows = convert_input([tmp_path / "lz4.arrow"], "arrow", tmp_path / "a", "id", None)
    assert rows == 500 and is_saved_dataset(tmp_path / "a")
    assert open_input(tmp_path / "a").select([499]).to_list() == [row(499)]
    (tmp_path / "mixed").mkdir()
    pq.write_table(_table(0, 10), tmp_path / "mixed" / "a.parquet")
    pq.write_table(_table(10, 20).drop_columns(["meta"]), tmp_path / "mixed" / "b.parquet")
    files = input_files(str(tmp_path / "mixed" / "*.parquet"))
    assert reference.plan_reference(files, "parquet") is None
    assert file_fingerprint(files, None, "parquet").get("method") is None  # content hashed, as before


def test_a_record_from_before_footers_keeps_its_content_hash(tmp_path: Path) -> None:
    """A run dir made by a version that hashed contents reopens: its record is not compared to footers."""
    paths = write_parquet(tmp_path / "corpus", files=1)
    content = file_fingerprint(paths, {"files": [], "fingerprint": "x"}, "parquet")
    assert "method" not in content and content["fingerprint"] != file_fingerprint(paths, None, "parquet")["fingerprint"]
    assert file_fingerprint(paths, content, "parquet") is content


def test_prepare_reads_each_footer_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # fingerprinting and referencing the corpus share one reading of its footers
    paths = write_parquet(tmp_path / "corpus")
    read: list[Path] = []
    real = reference.parquet_footer
    monkeypatch.setattr(reference, "parquet_footer", lambda p: (read.append(p), real(p))[1])
    reference._PLANS.clear()
    run = prepared(tmp_path, str(tmp_path / "corpus" / "*.parquet"))
    assert sorted(read) == sorted(paths) and len(open_input(run.input_dir)) == FILES * PER_FILE
    pq.write_table(pa.Table.from_pylist([row(i) for i in range(5)]), paths[0])  # rewritten: read again
    read.clear()
    file_fingerprint(paths, None, "parquet")
    assert sorted(read) == sorted(paths)
