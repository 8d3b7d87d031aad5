"""JSON lines that `datasets` reads itself (objects with varying keys in its first 10 MB, kept as
JSON text) whose later rows add a key or turn ints into floats (issue 26): read with its own types
extended over every row, each unchanged column exactly as it read it; a value it cannot cast is named
by file:line and column. No engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from batchinfer.errors import InputError
from batchinfer.inputs import datasets_reader
from batchinfer.inputs.convert import convert_input, open_input

# Past `datasets`' first chunk, where it takes its types from: 10 MB, made 64 KB here (the reader
# passes its chunk size to the builder), so that each file is ~100 KB instead of ~11 MB.
CHUNK = 64 << 10
BIG_ROWS = 1_100
BUILDERS_CHUNK = datasets_reader.DATASETS_CHUNK_BYTES  # as the reader has it, before the fixture shrinks it


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(datasets_reader, "DATASETS_CHUNK_BYTES", CHUNK)


def test_the_chunk_is_the_builders_own_default() -> None:
    """Shrinking it in these tests changes nothing else: it is what `datasets` would use anyway."""
    from datasets.packaged_modules.json.json import JsonConfig

    assert JsonConfig().chunksize == 10 << 20 == BUILDERS_CHUNK


def big_lines() -> list[str]:
    """~11 MB of rows: `meta` objects whose keys vary (JSON text to `datasets`), `info` objects whose
    keys do not (a struct), an int column `n`."""
    return [
        json.dumps(
            {"id": f"doc-{i:06d}", "n": i, "meta": {"a": i} if i % 2 else {"b": "x"}, "info": {"k": i}, "t": "x" * 24}
        )
        for i in range(BIG_ROWS)
    ]


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    assert path.stat().st_size > CHUNK
    return path


def converted(dest: Path, files: list[Path]) -> Any:
    rows = convert_input(files, "jsonl", dest, "id", None)
    ds = open_input(dest)
    assert rows == len(ds)
    return ds


@pytest.fixture(scope="module")
def as_before(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The rows without a late one, as `datasets` reads them."""
    d = tmp_path_factory.mktemp("before")
    return converted(d / "input", [write_lines(d / "a.jsonl", big_lines())])


def test_rows_after_the_first_10_mb_that_change_what_datasets_read(tmp_path: Path, as_before: Any) -> None:
    """A key added, an int column turned float, a key added inside an object: one row each."""
    late = [
        {"id": "late-1", "n": 7, "meta": {"c": [1]}, "info": {"k": 1}, "t": "t", "extra": "a new key"},
        {"id": "late-2", "n": 2.5, "meta": {"a": 1}, "info": {"k": 2}, "t": "t"},
        {"id": "late-3", "n": 8, "meta": {"b": "y"}, "info": {"k": 3, "new": True}, "t": "t"},
    ]
    p = write_lines(tmp_path / "b.jsonl", big_lines() + [json.dumps(row) for row in late])
    ds = converted(tmp_path / "input", [p])
    before = as_before
    changed = {
        "n": "Value('float64')",
        "info": "{'k': Value('int64'), 'new': Value('bool')}",
        "extra": "Value('string')",
    }
    assert {k: repr(v) for k, v in ds.features.items()} == {k: repr(v) for k, v in before.features.items()} | changed
    assert repr(ds.features["meta"]) == "Json(decode=True)"
    assert ds.select(range(BIG_ROWS, BIG_ROWS + 3)).to_list() == [
        late[0] | {"info": {"k": 1, "new": None}},
        late[1] | {"n": 2.5, "extra": None, "info": {"k": 2, "new": None}},
        late[2] | {"n": 8.0, "extra": None},
    ]
    # The rows before, column by column as `datasets` read them without the late rows (JSON text and all).
    head = ds.data.table.slice(0, BIG_ROWS)
    for name in before.column_names:
        if name not in changed:
            assert head.column(name).equals(before.data.table.column(name)), name
    assert head.column("extra").null_count == BIG_ROWS
    assert head.column("n").to_pylist() == [float(i) for i in range(BIG_ROWS)]
    assert ds.select([0, BIG_ROWS - 1])["info"] == [{"k": 0, "new": None}, {"k": BIG_ROWS - 1, "new": None}]


@pytest.mark.parametrize("same_file", [False, True], ids=["in a later file", "beside objects in its chunk"])
def test_a_value_datasets_cannot_cast_is_named_by_file_line_and_column(tmp_path: Path, same_file: bool) -> None:
    """A key added (which alone would be read) and text where `info` held objects: in a file of its
    own, or after the first 10 MB in a chunk whose other rows hold objects there (which `datasets`
    turns into JSON text, that cannot be cast to objects either)."""
    late = ['{"id": "late", "n": 1, "info": {"k": 1}, "extra": 1}', '{"id": "bad", "info": "t"}']
    a = write_lines(tmp_path / "a.jsonl", big_lines() + (late if same_file else []))
    files, bad = [a], f"{a}:{BIG_ROWS + 2}"
    if not same_file:
        b = tmp_path / "b.jsonl"
        b.write_text("".join(line + "\n" for line in late), encoding="utf-8")
        files, bad = [a, b], f"{b}:2"
    with pytest.raises(InputError) as e:
        converted(tmp_path / "input", files)
    assert str(e.value) == (
        f"{bad}: column 'info' holds text here but objects in the rows before; a column takes one type over "
        "all rows and files (integers and decimals make decimals, a missing key is null, nothing else mixes): "
        "write the objects of that column as JSON text (quoted strings), or move them to a column of their own"
    )
