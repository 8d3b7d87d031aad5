"""Every input format through the real engine (shared in-process engine, tiny model)."""

from __future__ import annotations

import base64
import datetime as dt
import gzip
import json
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest
from support.corpus import TIMESTAMP, assert_exactly_once, read_output
from support.runs import model_overrides

from batchinfer.config.compose import compose
from batchinfer.errors import InputError
from batchinfer.launch.local import run_local
from batchinfer.rundir.schema import jsonl_to_table

pytestmark = pytest.mark.engine
ROWS = [
    {"id": f"doc-{i:02d}", "text": t, "topic": "animals" if i % 2 else "science", "meta": {"text": f"nested {w}"}}
    for i, (t, w) in enumerate(
        [
            ("the quick brown fox", "dog"),
            ("label this abstract\nas physics", "world"),  # a quoted newline in CSV
            ('she said "hello, world"', "fox"),
            ("biology lazy dog", "hello"),
            ("jumps over the lazy dog", "quick"),
            ("physics or biology", "lazy"),
        ]
    )
]


def flat(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "meta"} for r in rows]


def write_input(tmp: Path, fmt: str) -> str:
    """The same rows in one format; returns input.path."""
    lines = "".join(json.dumps(r) + "\n" for r in ROWS)
    if fmt == "jsonl.gz":
        with gzip.open(tmp / "in.jsonl.gz", "wt") as f:
            f.write(lines)
        return str(tmp / "in.jsonl.gz")
    if fmt == "jsonl.zst":
        import zstandard

        (tmp / "in.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
        return str(tmp / "in.jsonl.zst")
    if fmt == "json":
        (tmp / "in.json").write_text(json.dumps(ROWS))
        return str(tmp / "in.json")
    if fmt in ("csv", "tsv"):
        import csv

        with open(tmp / f"in.{fmt}", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["id", "text", "topic"], delimiter="," if fmt == "csv" else "\t")
            w.writeheader()
            w.writerows(flat(ROWS))
        return str(tmp / f"in.{fmt}")
    table = pa.Table.from_pylist(ROWS)
    if fmt == "parquet":
        pq.write_table(table, tmp / "in.parquet")
        return str(tmp / "in.parquet")
    if fmt == "arrow":
        feather.write_feather(table, tmp / "in.arrow")
        return str(tmp / "in.arrow")
    if fmt == "hf_disk":
        import datasets

        datasets.Dataset(table).save_to_disk(str(tmp / "saved"))
        return str(tmp / "saved")
    if fmt == "glob":
        (tmp / "part-a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[:4]))
        (tmp / "part-b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[4:]))
        return str(tmp / "part-*.jsonl")
    raise AssertionError(fmt)


def run(tmp: Path, model: Path, engine: Any, path: str, *extra: str) -> list[dict]:
    ov = [f"input.path={path}", f"output.dir={tmp}/run", "input.id_column=id", "sampling.max_tokens=4"]
    return read_output(run_local(compose([*ov, *model_overrides(model), *extra]), engine=engine).path)


@pytest.mark.parametrize("fmt", ["jsonl.gz", "jsonl.zst", "json", "csv", "tsv", "parquet", "arrow", "hf_disk", "glob"])
def test_input_format(tmp_path: Path, tiny_model_path: Path, engine: Any, fmt: str) -> None:
    out = run(tmp_path, tiny_model_path, engine, write_input(tmp_path, fmt), "input.columns=[topic]")
    assert_exactly_once(out, ROWS)
    assert [r["input"] for r in out] == [{"topic": r["topic"]} for r in ROWS]


def test_nested_field_in_template_and_columns(tmp_path: Path, tiny_model_path: Path, engine: Any) -> None:
    path = write_input(tmp_path, "parquet")
    out = run(
        tmp_path, tiny_model_path, engine, path, "prompt.template=About {meta.text}", "input.columns=[meta.text,topic]"
    )
    assert_exactly_once(out, [dict(r, text=r["meta"]["text"]) for r in ROWS])
    assert out[0]["input"] == {"meta.text": "nested dog", "topic": "science"}


def test_merged_parquet_loads_with_datasets(tmp_path: Path, tiny_model_path: Path, engine: Any) -> None:
    import datasets

    run(tmp_path, tiny_model_path, engine, write_input(tmp_path, "jsonl.gz"), "sharding.num_shards=2")
    ds = datasets.load_dataset("parquet", data_files=str(tmp_path / "run" / "output.parquet"), split="train")
    assert ds["id"] == [r["id"] for r in ROWS] and ds.column_names[:3] == ["row", "id", "text"]


def test_input_errors_name_the_problem(tmp_path: Path, tiny_model_path: Path, engine: Any) -> None:
    (tmp_path / "header.csv").write_text("id,text\n")
    with pytest.raises(InputError, match=r"header.csv: no rows \(only a header\); there is nothing to run"):
        run(tmp_path, tiny_model_path, engine, str(tmp_path / "header.csv"))
    with pytest.raises(InputError, match=r"nothing-\*.jsonl: the pattern matches no file"):
        run(tmp_path, tiny_model_path, engine, str(tmp_path / "nothing-*.jsonl"))
    (tmp_path / "folder").mkdir()
    with pytest.raises(InputError, match="not a `Dataset.save_to_disk` folder"):
        run(tmp_path, tiny_model_path, engine, str(tmp_path / "folder"))
    with gzip.open(tmp_path / "bad.jsonl.gz", "wt") as f:
        f.write('{"id": "a", "text": "x"}\n{"id": "b", text}\n')
    with pytest.raises(InputError, match=r"bad.jsonl.gz:2: not valid JSON"):
        run(tmp_path, tiny_model_path, engine, str(tmp_path / "bad.jsonl.gz"))
    with pytest.raises(InputError, match=r"input.columns names 'meta.nope' but 'meta' has no field 'nope'"):
        run(tmp_path, tiny_model_path, engine, write_input(tmp_path, "parquet"), "input.columns=[meta.nope]")


@pytest.mark.engine
def test_carried_types_survive_resume_and_merge(tmp_path: Path, tiny_model_path: Path, engine: Any) -> None:
    from support.corpus import assert_own_output, write_corpus
    from support.runs import run_overrides

    from batchinfer.config.compose import compose
    from batchinfer.launch.local import run_local, run_shards
    from batchinfer.rundir.prepare import prepare
    from batchinfer.rundir.tables import read_table

    texts = write_corpus(tmp_path / "words.jsonl", 24, seed=5)
    n = len(texts)
    carried = {
        "day": pa.array([dt.date(2020, 1, 1) + dt.timedelta(days=i) if i % 5 else None for i in range(n)]),
        "at": pa.array([TIMESTAMP + dt.timedelta(hours=i) for i in range(n)], pa.timestamp("us", tz="Europe/Paris")),
        "price": pa.array([Decimal(f"{i}.{i:02d}") for i in range(n)], pa.decimal128(9, 2)),
        "blob": pa.array([bytes([i, 255 - i, 0]) for i in range(n)], pa.binary()),
    }
    ids = pa.array([f"\x00id-{i}".encode() + b"\xff" for i in range(n)], pa.binary())  # not even UTF-8
    corpus = tmp_path / "corpus.parquet"
    pq.write_table(pa.table({"id": ids, "text": [r["text"] for r in texts], **carried}), corpus)
    ov = run_overrides(
        tiny_model_path,
        corpus,
        tmp_path / "run",
        "output.format=jsonl",
        "sharding.num_shards=2",
        "output.commit_every_rows=4",
        "input.columns=[day,at,price,blob]",
    )
    run = prepare(compose(ov))
    assert run.schema.field("id").type == pa.binary()
    run_shards(run, [0], engine)  # then stopped: shard 1 never started
    assert run.shard_folder(0).is_done() and not run.shard_folder(1).is_done()
    # the committed JSONL part reads back typed
    first = read_table(run.shard_folder(0).committed_files()[0], run.schema)
    assert first.column("input").type == run.schema.field("input").type
    run = run_local(compose(ov), engine=engine)

    out = jsonl_to_table(run.output_path.read_bytes(), run.schema)
    assert out.column("row").to_pylist() == list(range(n)) and out.column("id").equals(pa.chunked_array([ids]))
    got = out.column("input").combine_chunks()
    for name, values in carried.items():
        assert got.field(name).equals(values), name
    for row, text in zip(out.to_pylist(), texts, strict=True):
        assert row["error"] is None
        assert_own_output(row, text["text"])
    # What a pandas or jq user reads in output.jsonl.
    line = json.loads(run.output_path.read_text().splitlines()[1])
    assert line["id"] == base64.b64encode(b"\x00id-1\xff").decode()
    assert line["input"] == {
        "day": "2020-01-02",
        "at": "2024-03-01T01:59:58.123456+01:00",
        "price": "1.01",
        "blob": base64.b64encode(bytes([1, 254, 0])).decode(),
    }
