"""JSON lines whose rows or files differ in columns or types (issue 26): one schema over all rows of
all files (a new column is null elsewhere, integers and decimals make decimals), still streamed by
pyarrow; a value no promotion joins is named by file:line and column, with what to do. No engine."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from support.runs import fake_model_dir

from batchinfer.config.compose import compose
from batchinfer.errors import InputError
from batchinfer.inputs import convert, datasets_reader, jsonl_stream
from batchinfer.inputs.convert import convert_input, open_input
from batchinfer.inputs.paths import input_files
from batchinfer.inputs.textfiles import TypesDiffer, unify_types
from batchinfer.rundir.prepare import prepare

# Past `datasets`' first 10 MB chunk, where it took its types from before.
BIG_ROWS = 110_000


def big_lines() -> list[str]:
    """~11 MB of rows with an int column `n`."""
    return [json.dumps({"id": f"doc-{i:06d}", "n": i, "text": f"row {i} " + "x" * 60}) for i in range(BIG_ROWS)]


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


@pytest.fixture
def no_old_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """pyarrow's stream must read these inputs, not `datasets` (whose reading of them failed)."""

    def old_path(*args: Any) -> Any:
        raise AssertionError("read by datasets, not streamed")

    monkeypatch.setattr(convert, "read_with_datasets", old_path)


def converted(tmp_path: Path, files: list[Path]) -> Any:
    rows = convert_input(files, "jsonl", tmp_path / "input", "id", None)
    ds = open_input(tmp_path / "input")
    assert rows == len(ds)
    return ds


@pytest.mark.parametrize(
    "last, features, got",
    [
        (
            {"id": "late", "n": 7, "text": "t", "extra": "a new key"},
            {"id": "string", "n": "int64", "text": "string", "extra": "string"},
            {"id": "late", "n": 7, "text": "t", "extra": "a new key"},
        ),
        (
            {"id": "late", "n": 2.5, "text": "t"},
            {"id": "string", "n": "float64", "text": "string"},
            {"id": "late", "n": 2.5, "text": "t"},
        ),
    ],
    ids=["a key added", "an int column turned float"],
)
def test_a_row_after_the_first_10_mb_that_changes_the_schema(
    tmp_path: Path, no_old_path: None, last: dict, features: dict, got: dict
) -> None:
    lines = big_lines()
    p = write_lines(tmp_path / "c.jsonl", lines + [json.dumps(last)])
    assert p.stat().st_size > 10 << 20
    ds = converted(tmp_path, [p])
    assert {k: v.dtype for k, v in ds.features.items()} == features
    assert ds[BIG_ROWS] == got
    first = ds.select([0, BIG_ROWS - 1]).to_list()
    assert [r["n"] for r in first] == [0, BIG_ROWS - 1] and all(r.get("extra") is None for r in first)
    assert first[1] == dict(json.loads(lines[-1]), **({"extra": None} if "extra" in features else {}))


def test_a_glob_of_files_that_differ_in_columns_and_types(tmp_path: Path, no_old_path: None) -> None:
    """Through prepare: one schema over the files (a compressed one among them), each row as written,
    a column or key a file lacks null in its rows."""
    d = tmp_path / "in"
    d.mkdir()
    write_lines(
        d / "part-1.jsonl", ['{"id": 1, "n": 1, "text": "a", "meta": {"a": 1}}', '{"id": 2, "n": 2, "text": "b"}']
    )
    (d / "part-2.jsonl.gz").write_bytes(
        gzip.compress(b'{"id": 3, "n": 2.5, "meta": {"a": 3, "b": "x"}, "flag": true, "tags": []}\n')
    )
    write_lines(d / "part-3.jsonl", ['{"id": 4, "text": "d", "tags": ["p", "q"], "when": null}'])
    ov = [
        f"input.path={d}/part-*",
        "input.format=jsonl",
        "input.id_column=id",
        f"model.path={fake_model_dir(tmp_path)}",
        f"output.dir={tmp_path}/run",
        "prompt.template=Say {text}",
    ]
    assert len(input_files(f"{d}/part-*")) == 3
    ds = open_input(prepare(compose(ov)).input_dir)
    assert ds.data.schema.names == ["id", "n", "text", "meta", "flag", "tags", "when"]
    assert ds.data.schema.field("n").type == pa.float64()
    assert ds.to_list() == [
        {"id": 1, "n": 1.0, "text": "a", "meta": {"a": 1, "b": None}, "flag": None, "tags": None, "when": None},
        {"id": 2, "n": 2.0, "text": "b", "meta": None, "flag": None, "tags": None, "when": None},
        {"id": 3, "n": 2.5, "text": None, "meta": {"a": 3, "b": "x"}, "flag": True, "tags": [], "when": None},
        {"id": 4, "n": None, "text": "d", "meta": None, "flag": None, "tags": ["p", "q"], "when": None},
    ]


def test_the_schema_pass_starts_where_the_types_stopped_fitting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_old_path: None
) -> None:
    """Small blocks and chunks: the rows streamed before the misfit are not parsed again, and the last
    line, without a newline, is not skipped with them."""
    monkeypatch.setattr(datasets_reader, "DATASETS_CHUNK_BYTES", 1 << 10)
    monkeypatch.setattr(jsonl_stream, "JSONL_BLOCK_BYTES", 1 << 10)
    monkeypatch.setattr(jsonl_stream, "SCHEMA_CHUNK_BYTES", 300)
    parsed: list[int] = []
    real = jsonl_stream.unify_schemas
    monkeypatch.setattr(jsonl_stream, "unify_schemas", lambda a, b: (parsed.append(1), real(a, b))[1])
    lines = [json.dumps({"id": i, "n": i}) for i in range(400)] + ['{"id": 400, "n": 0.5, "new": "k"}']
    p = tmp_path / "c.jsonl"
    p.write_text("\n".join(lines), encoding="utf-8")
    ds = converted(tmp_path, [p])
    assert ds.to_list() == [{"id": i, "n": float(i), "new": None} for i in range(400)] + [
        {"id": 400, "n": 0.5, "new": "k"}
    ]
    chunks = -(-p.stat().st_size // 300)
    assert 1 <= len(parsed) < chunks // 2


TEXT_FIX = "write the objects of that column as JSON text (quoted strings), or move them to a column of their own"
RULE = (
    "a column takes one type over all rows and files (integers and decimals make decimals, a missing "
    "key is null, nothing else mixes): "
)


@pytest.mark.parametrize("chunk", [8 << 20, 300], ids=["one chunk a file", "many chunks"])
def test_a_value_no_promotion_joins_is_named_by_file_line_and_column(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    """An object where earlier files had text: `datasets` could not read it either; the line is
    counted across chunks, blank and CRLF lines included."""
    monkeypatch.setattr(jsonl_stream, "SCHEMA_CHUNK_BYTES", chunk)
    d = tmp_path / "in"
    d.mkdir()
    write_lines(d / "a.jsonl", [json.dumps({"id": i, "m": {"k": i}}) for i in range(40)])
    b = d / "b.jsonl"
    rows = [json.dumps({"id": 100 + i, "m": {"k": i}}) for i in range(30)]
    b.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(rows[:20] + ["", *rows[20:], '{"id": 1000, "m": "text"}']).encode())
    with pytest.raises(InputError) as e:
        convert_input([d / "a.jsonl", b], "jsonl", tmp_path / "input", "id", None)
    assert str(e.value) == f"{b}:32: column 'm' holds text here but objects in the rows before; {RULE}{TEXT_FIX}"


def test_a_conflict_after_the_first_10_mb_and_inside_lists(tmp_path: Path) -> None:
    lines = big_lines()
    p = write_lines(tmp_path / "c.jsonl", lines + ['{"id": "late", "n": [1, 2], "text": "t"}'])
    with pytest.raises(InputError) as e:
        converted(tmp_path, [p])
    one_kind = "make that column's values one kind in every row, or move the odd ones to a column of their own"
    assert (
        str(e.value)
        == f"{p}:{BIG_ROWS + 1}: column 'n' holds a list here but numbers in the rows before; {RULE}{one_kind}"
    )
    # in a later file, inside a list inside an object
    q1 = write_lines(tmp_path / "l1.jsonl", ['{"id": 1, "m": {"t": [1, 2.5]}}'])
    q2 = write_lines(tmp_path / "l2.jsonl", ['{"id": 2, "m": {"t": []}}', '{"id": 3, "m": {"t": [4, "x"]}}'])
    with pytest.raises(InputError) as e:
        converted(tmp_path, [q1, q2])
    as_text = "write the numbers of that column as JSON text (quoted strings), or move them to a column of their own"
    assert (
        str(e.value) == f"{q2}:2: column 'm.t' (inside a list) holds text here but numbers before it; {RULE}{as_text}"
    )


def test_what_datasets_read_before_is_read_as_before(tmp_path: Path) -> None:
    """Text first and an object in a later file: `datasets` keeps the object as JSON text; that stays."""
    a = write_lines(tmp_path / "a.jsonl", ['{"id": 1, "m": "text"}'])
    b = write_lines(tmp_path / "b.jsonl", ['{"id": 2, "m": {"k": 1}}'])
    assert converted(tmp_path, [a, b]).to_list() == [{"id": 1, "m": "text"}, {"id": 2, "m": '{"k":1}'}]


def test_unify_types() -> None:
    s, i, f = pa.string(), pa.int64(), pa.float64()
    assert unify_types(i, f) == f and unify_types(pa.null(), s) == s and unify_types(s, pa.null()) == s
    assert unify_types(pa.timestamp("s"), s) == s  # ISO dates (pyarrow's timestamps) and other texts
    assert unify_types(pa.struct([("a", i)]), pa.struct([("b", s), ("a", f)])) == pa.struct([("a", f), ("b", s)])
    assert unify_types(pa.list_(pa.null()), pa.list_(i)) == pa.list_(i)
    for before, found, differ in [
        (s, pa.struct([("a", i)]), ((), s, pa.struct([("a", i)]))),
        (pa.struct([("a", i)]), pa.struct([("a", s)]), (("a",), i, s)),
        (pa.list_(i), pa.list_(pa.bool_()), (("[]",), i, pa.bool_())),
        (pa.bool_(), i, ((), pa.bool_(), i)),
    ]:
        with pytest.raises(TypesDiffer) as e:
            unify_types(before, found)
        assert (e.value.path, e.value.before, e.value.found) == differ
