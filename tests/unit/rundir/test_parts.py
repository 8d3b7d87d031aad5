"""Parts and the output: the schema, atomic part commits, the shard lock, merge refusals and a full disk."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pytest
from support.corpus import read_output, write_corpus
from support.fake_engine import FakeEngine, fake_overrides, keyed, prepared

from batchinfer.config.compose import compose
from batchinfer.errors import RunDirError
from batchinfer.launch.local import run_shards
from batchinfer.locks import ShardLock
from batchinfer.rundir.merge import merge
from batchinfer.rundir.prepare import prepare
from batchinfer.rundir.schema import error_row, output_schema, rows_to_table


def test_schema_keeps_null_optional_columns_concatenable(tmp_path: Path) -> None:
    schema = output_schema(pa.string(), 2, pa.struct([("topic", pa.string())]))
    ok = rows_to_table([{"row": 0, "id": "a", "text": "t", "samples": ["t", "u"], "error": None}], schema)
    bad = rows_to_table([error_row(1, "b", "prompt", "field 'text' is null")], schema)
    both = pa.concat_tables([ok, bad])
    assert both.schema == schema
    assert both.column("samples").to_pylist() == [["t", "u"], None]
    assert both.column("error").to_pylist()[1] == {"kind": "prompt", "message": "field 'text' is null"}


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_part_commit_is_atomic_and_temporaries_are_cleaned(tmp_path: Path, fmt: str) -> None:
    run = prepared(tmp_path, 4, f"output.format={fmt}")
    run.shard_dir(0).mkdir(parents=True)
    table = rows_to_table([error_row(i, f"doc-{i:05d}", "x", "m") for i in (1, 0)], run.schema)
    p0 = run.shard_folder(0).write_part(table)
    p1 = run.shard_folder(0).write_part(rows_to_table([error_row(2, "doc-00002", "x", "m")], run.schema))
    assert [p0.name, p1.name] == [f"part-000000.{fmt}", f"part-000001.{fmt}"]
    (run.shard_dir(0) / f".tmp-part-000002.{fmt}").write_bytes(b"torn")
    assert [p.name for p in run.shard_folder(0).committed_files()] == [p0.name, p1.name]
    assert run.shard_folder(0).read_rows().column("row").to_pylist() == [1, 0, 2]
    assert run.shard_folder(0).remove_temporaries_and_leftovers() == 1
    assert sorted(os.listdir(run.shard_dir(0))) == [p0.name, p1.name]


def test_lock_refuses_second_writer_naming_holder(tmp_path: Path) -> None:
    d = tmp_path / "shard"
    with ShardLock(d, mode="auto"):
        with pytest.raises(RunDirError, match=rf"shard is being written by host \S+ pid {os.getpid()}"):
            with ShardLock(d, mode="auto"):
                pass
    with ShardLock(d, mode="auto"):  # released: free again
        pass


def test_merge_refuses_naming_incomplete_shards(tmp_path: Path) -> None:
    run = prepared(tmp_path, 9, "sharding.num_shards=3")
    with pytest.raises(RunDirError, match=r"3 of 3 shards are incomplete \(shards 0, 1, 2\)"):
        merge(run)


@pytest.mark.parametrize(
    "error",
    [
        OSError(28, "No space left on device"),
        OSError("[Errno 28] Error writing bytes to file: No space left on device"),
    ],
)
def test_merge_on_a_full_disk_leaves_no_partial_output(tmp_path: Path, monkeypatch, error: OSError) -> None:
    """pyarrow puts the errno only in its message: both forms are a StorageError naming the output."""
    from batchinfer.errors import StorageError
    from batchinfer.rundir import merge as merge_module

    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 12)
    run = prepare(compose(fake_overrides(tmp_path, corpus, "sharding.num_shards=2")))
    run_shards(run, [0, 1], engine=keyed(FakeEngine(), run))
    calls = {"n": 0}
    real = merge_module.OutputWriter.write

    def write(self, table):  # the second shard's rows hit a full disk
        calls["n"] += 1
        if calls["n"] == 2:
            raise error
        real(self, table)

    monkeypatch.setattr(merge_module.OutputWriter, "write", write)
    with pytest.raises(StorageError, match=rf"cannot write {run.output_path}: the disk is full"):
        merge(run)
    assert not run.output_path.exists() and not list(run.path.glob(".tmp-*"))
    monkeypatch.setattr(merge_module.OutputWriter, "write", real)
    assert merge(run)["rows"] == 12 and len(read_output(run.path)) == 12


def test_a_part_is_written_without_dictionary_pages(tmp_path: Path) -> None:
    """Parts are Parquet without dictionaries (ids, answers and digests are unique strings: a
    dictionary made the commit slower and the part ~3x larger); the rows read back the same."""
    import pyarrow.parquet as pq

    run = prepared(tmp_path, 4)
    run.shard_dir(0).mkdir(parents=True)
    table = rows_to_table([error_row(i, f"doc-{i:05d}", "x", "m") for i in range(3)], run.schema)
    part = run.shard_folder(0).write_part(table)
    meta = pq.ParquetFile(part).metadata
    columns = [meta.row_group(0).column(i) for i in range(meta.num_columns)]
    assert [c.path_in_schema for c in columns if c.has_dictionary_page] == []
    assert not any("DICTIONARY" in e for c in columns for e in c.encodings)
    assert run.shard_folder(0).read_rows().equals(table)


def test_a_shard_with_parts_written_with_dictionaries_resumes_and_keeps_them(tmp_path: Path) -> None:
    """A run committed before parts lost their dictionaries (pyarrow's default writer options) goes
    on: the old part is not rewritten, the rows it holds are not redone, and the output equals an
    uninterrupted run's."""
    import pyarrow.parquet as pq

    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 12)
    for d in "ab":
        (tmp_path / d).mkdir()
    clean = prepare(compose(fake_overrides(tmp_path / "a", corpus, "input.id_column=id", "sharding.num_shards=1")))
    run_shards(clean, [0], engine=keyed(FakeEngine(), clean))
    merge(clean)
    want = read_output(clean.path)

    run = prepare(compose(fake_overrides(tmp_path / "b", corpus, "input.id_column=id", "sharding.num_shards=1")))
    first = clean.shard_folder(0).read_rows().sort_by("row").slice(0, 5)
    run.shard_dir(0).mkdir(parents=True)
    old = run.shard_dir(0) / "part-000000.parquet"
    pq.write_table(first, old, compression="zstd")  # the writer's options before: dictionaries on
    assert pq.ParquetFile(old).metadata.row_group(0).column(1).has_dictionary_page
    engine = keyed(FakeEngine(), run)
    run_shards(run, [0], engine=engine)
    assert len(engine.added) == 7  # the old part's 5 rows were not sent again
    assert run.shard_folder(0).done_record()["parts"] == 2  # the old part and one new one
    merge(run)

    def answers(rows: list[dict]) -> list[dict]:  # the request digest names the model folder, which differs
        return [{k: v for k, v in r.items() if k != "request_digest"} for r in rows]

    assert answers(read_output(run.path)) == answers(want)
