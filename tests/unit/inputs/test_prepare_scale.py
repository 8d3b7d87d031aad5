"""Preparing a big JSON lines input: pyarrow streams it into DIR/input, ids are checked with Arrow
compute in bounded passes, and the line-by-line scan only runs to name a bad line. No engine."""

from __future__ import annotations

import gzip
import json
import math
import random
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa
import pytest
import zstandard
from support.runs import fake_model_dir

from batchinfer.config.compose import compose
from batchinfer.errors import InputError
from batchinfer.inputs import convert, datasets_reader, idcheck, jsonl_stream
from batchinfer.inputs.convert import convert_input, open_input
from batchinfer.inputs.idcheck import check_ids, id_problems
from batchinfer.inputs.line_counts import count_lines
from batchinfer.inputs.paths import input_files, is_saved_dataset
from batchinfer.rundir.prepare import prepare
from batchinfer.rundir.store import RunDir

ROWS = 50_000


def row(i: int) -> dict[str, Any]:
    """A row like the benchmark corpus's: id, text, a nested object with a list."""
    return {
        "id": f"doc-{i:06d}",
        "text": f'row {i}: caf\u00e9 \u00fcber "quoted" \\ back\tslash \U0001f600',
        "meta": {"source": ["crawl", "books"][i % 2], "score": i / 7, "tags": ["a", "b"][: 1 + i % 2]},
    }


def write_lines(path: Path, lines: list[str], end: str = "\n") -> Path:
    path.write_text("".join(line + end for line in lines), encoding="utf-8")
    return path


def corpus(path: Path, n: int = ROWS) -> Path:
    return write_lines(path, [json.dumps(row(i)) for i in range(n)])


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How often the old path ran (line-by-line scan, then `datasets`' reader), and the scan in it."""
    seen = {"scan": 0, "old_path": 0}
    scan, load = datasets_reader.scan_jsonl, convert.read_with_datasets

    def counted_scan(path: Path) -> int:
        seen["scan"] += 1
        return scan(path)

    def counted_load(*args: Any) -> Any:
        seen["old_path"] += 1
        return load(*args)

    monkeypatch.setattr(datasets_reader, "scan_jsonl", counted_scan)
    monkeypatch.setattr(convert, "read_with_datasets", counted_load)
    return seen


def converted(tmp_path: Path, files: list[Path], id_column: Optional[str] = "id") -> tuple[Any, int]:
    dest = tmp_path / "input"
    rows = convert_input(files, "jsonl", dest, id_column, None)
    return open_input(dest), rows


def as_datasets_read(tmp_path: Path, files: list[Path]) -> Any:
    """What the conversion gave before: `datasets`' own JSON reader on the same files."""
    import datasets

    return datasets.Dataset.from_json([str(f) for f in files], cache_dir=str(tmp_path / "ref-cache"))


def same_rows(a: list[dict], b: list[dict]) -> bool:
    """Equal, NaN equal to NaN."""

    def norm(v: Any) -> Any:
        if isinstance(v, float) and math.isnan(v):
            return "NaN"
        if isinstance(v, dict):
            return {k: norm(x) for k, x in v.items()}
        if isinstance(v, list):
            return [norm(x) for x in v]
        return v

    return norm(a) == norm(b)


# ---------------------------------------------------------------- same input as before


def varied_inputs(d: Path) -> dict[str, tuple[list[Path], bool]]:
    """name -> (files, whether pyarrow's stream is enough); each also read by `datasets` as before."""
    d.mkdir()
    rows = [json.dumps(row(i)) for i in range(300)]
    (d / "c.jsonl.gz").write_bytes(gzip.compress("".join(r + "\n" for r in rows).encode()))
    (d / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress("".join(r + "\n" for r in rows).encode()))
    (d / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + "\r\n\r\n".join(rows).encode() + b"\r\n  \n\t")
    write_lines(d / "part-1.jsonl", rows[:100])
    write_lines(d / "part-2.jsonl", rows[100:])
    write_lines(d / "other-1.jsonl", ['{"id": 1, "x": 1.5, "s": "a"}'])
    write_lines(d / "other-2.jsonl", ['{"id": 2, "x": 2, "s": "b"}'])
    write_lines(d / "str-1.jsonl", ['{"id": 1, "s": "a"}'])
    write_lines(d / "str-2.jsonl", ['{"id": 2, "s": 5}'])
    scalars = ['{"id": 1, "n": 1, "f": 1.5, "b": true, "s": null}', '{"id": 2, "n": 2.5, "f": NaN, "b": false}']
    return {
        "nested": ([corpus(d / "nested.jsonl", 300)], True),
        "gzip": ([d / "c.jsonl.gz"], True),
        "zstd": ([d / "c.jsonl.zst"], True),
        "bom, CRLF, blank lines, no last newline": ([d / "bom.jsonl"], True),
        "two files": ([d / "part-1.jsonl", d / "part-2.jsonl"], True),
        "scalars, int and float mixed, NaN": ([write_lines(d / "scalars.jsonl", scalars)], True),
        "a null field in an object": (
            [write_lines(d / "nullfield.jsonl", ['{"id": 1, "m": {"a": 1}}', '{"id": 2, "m": {"a": null}}'])],
            True,
        ),
        # `datasets` keeps objects with varying keys, or empty ones, as JSON text: left to it
        "objects with varying keys": (
            [write_lines(d / "vary.jsonl", ['{"id": 1, "m": {"a": 1}}', '{"id": 2, "m": {"b": "x"}}'])],
            False,
        ),
        "empty object": ([write_lines(d / "empty.jsonl", ['{"id": 1, "m": {}}'])], False),
        "a list of objects with varying keys": (
            [write_lines(d / "listvary.jsonl", ['{"id": 1, "l": [{"a": 1}, {"b": 2}]}'])],
            False,
        ),
        # int and str ids: pyarrow refuses the mixed column, `datasets` keeps it as JSON text
        "mixed int and str ids": ([write_lines(d / "mixed.jsonl", ['{"id": 1}', '{"id": "b"}', '{"id": 3}'])], False),
        # a value of another type after the first chunk (made small here): one schema over all rows,
        # int and float make float, as `datasets` reads it where its own first chunk holds both
        "an int field, then a float after the first chunk": (
            [
                write_lines(
                    d / "late.jsonl", [f'{{"id": {i}, "x": {i}}}' for i in range(10_000)] + ['{"id": -1, "x": 2.5}']
                )
            ],
            True,
        ),
        "a later file with ints where the first has floats": ([d / "other-1.jsonl", d / "other-2.jsonl"], True),
        "a later file with an int where the first has a string": ([d / "str-1.jsonl", d / "str-2.jsonl"], False),
    }


INPUTS = [
    "nested",
    "gzip",
    "zstd",
    "bom, CRLF, blank lines, no last newline",
    "two files",
    "scalars, int and float mixed, NaN",
    "a null field in an object",
    "objects with varying keys",
    "empty object",
    "a list of objects with varying keys",
    "mixed int and str ids",
    "an int field, then a float after the first chunk",
    "a later file with ints where the first has floats",
    "a later file with an int where the first has a string",
]


@pytest.mark.parametrize("chunk", [1 << 16, 1 << 12])
@pytest.mark.parametrize("name", INPUTS)
def test_same_rows_and_types_as_datasets_read_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, calls: dict[str, int], name: str, chunk: int
) -> None:
    """Every kind of JSON lines input gives the rows and types `datasets` gave before (the old
    conversion); pyarrow's stream alone does it where it can, with no line-by-line scan. With the
    first chunk made 4 KB, most files go on past it: their stream starts where it ends (a BOM, a
    compressed file's decompressed bytes, CRLF and blank lines included)."""
    monkeypatch.setattr(datasets_reader, "DATASETS_CHUNK_BYTES", chunk)
    files, fast = varied_inputs(tmp_path / "in")[name]
    # ints beside strings cannot be ids (one type per id column): that file is read without an id column
    ds, rows = converted(tmp_path, files, None if name == "mixed int and str ids" else "id")
    ref = as_datasets_read(tmp_path, files)
    assert rows == len(ref) == len(ds)
    assert ds.features == ref.features
    assert same_rows(ds.to_list(), ref.to_list())
    # what the worker reads: a selection of rows, as Python dicts
    pick = [rows - 1, 0]
    assert same_rows(ds.select(pick).to_list(), ref.select(pick).to_list())
    assert calls == ({"scan": 0, "old_path": 0} if fast else {"scan": len(files), "old_path": 1})


def test_the_first_chunk_is_parsed_once_and_a_bad_line_after_it_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, calls: dict[str, int]
) -> None:
    """The rows of the first chunk, read for the types, are written as they are: the stream of that
    file starts after it (at its size, a BOM counted). A line that is no object right after it is
    still refused by its line."""
    monkeypatch.setattr(datasets_reader, "DATASETS_CHUNK_BYTES", 1 << 12)
    starts: list[int] = []
    source = jsonl_stream._arrow_source
    monkeypatch.setattr(jsonl_stream, "_arrow_source", lambda path, skip=0: starts.append(skip) or source(path, skip))
    lines = [json.dumps(row(i)) for i in range(500)]
    p = tmp_path / "c.jsonl"
    p.write_bytes(b"\xef\xbb\xbf" + "".join(line + "\n" for line in lines).encode())
    ds, rows = converted(tmp_path, [p])
    assert rows == 500 and ds.to_list() == [row(i) for i in range(500)] and calls == {"scan": 0, "old_path": 0}
    head = len(datasets_reader.first_chunk(p))
    assert starts == [head + 3] and p.read_bytes()[head + 2 : head + 3] == b"\n"
    # The same lines without the BOM, `null` the first line after the first chunk
    after = datasets_reader.first_chunk(write_lines(tmp_path / "plain.jsonl", lines)).count(b"\n")
    bad = write_lines(tmp_path / "bad.jsonl", lines[:after] + ["null"] + lines[after:])
    assert datasets_reader.first_chunk(bad).count(b"\n") == after
    with pytest.raises(InputError) as e:
        converted(tmp_path / "b", [bad])
    assert str(e.value).startswith(f"{bad}:{after + 1}: expected a JSON object per line, got null")


def test_a_row_longer_than_a_block_after_the_first_chunk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, calls: dict[str, int]
) -> None:
    """Blocks are sized from the first chunk's longest line; a longer row further on gets one more
    try with bigger blocks, not the slow path."""
    monkeypatch.setattr(datasets_reader, "DATASETS_CHUNK_BYTES", 1 << 16)
    lines = [json.dumps(row(i)) for i in range(2000)]
    lines[1500] = json.dumps(dict(row(1500), text="long " * (1 << 19)))  # 2.5 MB, blocks start at 1 MB
    p = write_lines(tmp_path / "long.jsonl", lines)
    ds, rows = converted(tmp_path, [p])
    assert rows == 2000 and ds[1500]["text"] == "long " * (1 << 19) and ds[1999] == row(1999)
    assert calls == {"scan": 0, "old_path": 0}


def test_input_dir_is_a_saved_dataset_and_nothing_else(tmp_path: Path, calls: dict[str, int]) -> None:
    p = corpus(tmp_path / "c.jsonl", 1000)
    ds, rows = converted(tmp_path, [p])
    assert rows == 1000 and calls == {"scan": 0, "old_path": 0}
    assert sorted(f.name for f in (tmp_path / "input").iterdir()) == [
        "data-00000-of-00001.arrow",
        "dataset_info.json",
        "state.json",
    ]
    assert sorted(f.name for f in tmp_path.iterdir()) == ["c.jsonl", "input"]  # no cache, no ids file left
    assert is_saved_dataset(tmp_path / "input")
    assert ds[999] == row(999) and ds.data.schema.field("meta").type.field("tags").type == pa.list_(pa.string())


def test_blocks_are_written_as_few_big_record_batches(tmp_path: Path, calls: dict[str, int]) -> None:
    """Every task that opens DIR/input maps pages around each batch's header: 1 MB blocks are
    gathered into batches of ~32 MB before they are written."""
    p = corpus(tmp_path / "c.jsonl")
    assert p.stat().st_size > 5 * jsonl_stream.JSONL_BLOCK_BYTES
    ds, rows = converted(tmp_path, [p])
    with pa.memory_map(str(tmp_path / "input" / jsonl_stream.DATA_FILE)) as source:
        batches = list(pa.ipc.open_stream(source))
    assert [b.num_rows for b in batches] == [ROWS] and calls == {"scan": 0, "old_path": 0}
    assert ds.select([ROWS - 1]).to_list() == [row(ROWS - 1)]


def test_prepare_through_the_fast_path(tmp_path: Path, calls: dict[str, int]) -> None:
    p = corpus(tmp_path / "c.jsonl", 3000)
    run = prepare(
        compose(
            [
                f"input.path={p}",
                "input.id_column=id",
                "input.columns=[meta.source]",
                f"model.path={fake_model_dir(tmp_path)}",
                f"output.dir={tmp_path}/run",
                "sharding.rows_per_shard=1000",
            ]
        )
    )
    assert calls == {"scan": 0, "old_path": 0}
    run = RunDir(run.path)
    assert [s.rows for s in run.shards()] == [1000, 1000, 1000] and run.run["input"]["rows"] == 3000
    assert open_input(run.input_dir).select([2999]).to_list() == [row(2999)]


# ---------------------------------------------------------------- ids


def test_a_duplicate_id_among_50k_rows_names_both_rows(tmp_path: Path, calls: dict[str, int]) -> None:
    lines = [json.dumps(row(i)) for i in range(ROWS)]
    lines[41_234] = json.dumps(row(7))
    p = write_lines(tmp_path / "dup.jsonl", lines)
    with pytest.raises(InputError) as e:
        converted(tmp_path, [p])
    assert str(e.value) == f"{p}: duplicate id 'doc-000007' in rows 7 and 41234; ids must be unique"
    assert calls == {"scan": 0, "old_path": 0} and not (tmp_path / "input").exists()


def test_a_null_or_missing_id_is_named(tmp_path: Path, calls: dict[str, int]) -> None:
    lines = [json.dumps(row(i)) for i in range(ROWS)]
    lines[30_000] = json.dumps({"text": "no id", "meta": row(0)["meta"]})
    lines[40_000] = json.dumps(dict(row(40_000), id=None))
    p = write_lines(tmp_path / "null.jsonl", lines)
    with pytest.raises(InputError) as e:
        converted(tmp_path, [p])
    assert str(e.value) == f"{p}: row 30000: input.id_column 'id' is null or missing; every row needs an id"
    assert calls == {"scan": 0, "old_path": 0}


def test_an_id_column_that_is_not_there(tmp_path: Path) -> None:
    p = corpus(tmp_path / "c.jsonl", 10)
    with pytest.raises(InputError) as e:
        converted(tmp_path, [p], id_column="key")
    assert str(e.value) == f"{p}: input.id_column='key' is not a column (columns: id, text, meta)"


def dict_id_problems(values: list[Any], column: str, limit: int = 5) -> tuple[int, list[str]]:
    """The id check as it was: every id in a Python dict."""
    count, shown, seen = 0, [], {}
    for i, value in enumerate(values):
        if value is None:
            msg = f"row {i}: input.id_column {column!r} is null or missing; every row needs an id"
        elif value in seen:
            msg = f"duplicate id {value!r} in rows {seen[value]} and {i}; ids must be unique"
        else:
            seen[value] = i
            continue
        count += 1
        if len(shown) < limit:
            shown.append(msg)
    return count, shown


def random_ids(rng: random.Random, n: int, kind: str) -> list[Any]:
    ids: list[Any] = [rng.randrange(n * 20) for _ in range(n)]
    if kind == "str":
        ids = [f"k{v}" for v in ids]
    for _ in range(n // 500):
        ids[rng.randrange(n)] = None
    return ids


def chunked(rng: random.Random, values: list[Any], typ: Optional[pa.DataType] = None) -> pa.ChunkedArray:
    """values in chunks of 1 to 3,000."""
    cuts = [0]
    while cuts[-1] < len(values):
        cuts.append(min(len(values), cuts[-1] + rng.randint(1, 3000)))
    return pa.chunked_array([pa.array(values[a:b], typ) for a, b in zip(cuts, cuts[1:], strict=False)], typ)


@pytest.mark.parametrize("kind", ["int", "str", "long str"])
@pytest.mark.parametrize("collide", [False, True])
def test_id_check_finds_what_a_dict_finds(monkeypatch: pytest.MonkeyPatch, kind: str, collide: bool) -> None:
    """Hashes sorted in place, then the ids of repeated hashes compared: the same count and rows as a
    dict of every id, the first problems in row order, each duplicate with its first row; also when
    many different ids share a hash (collide)."""
    if collide:
        hashes = idcheck._id_hashes
        monkeypatch.setattr(idcheck, "_id_hashes", lambda chunk: hashes(chunk) % 7)
    rng = random.Random(kind)
    values = random_ids(rng, 20_000, "int" if kind == "int" else "str")
    if kind == "long str":
        values = [v if v is None else v * rng.choice([1, 1, 40]) for v in values]
    ids = chunked(rng, values)
    for limit in (1, 5, 50):
        assert id_problems(ids, "id", limit) == dict_id_problems(values, "id", limit)
    assert id_problems(pa.chunked_array([[1, 2, 3]]), "id") == (0, [])


def test_an_id_repeated_beside_ids_of_other_lengths_is_found() -> None:
    """A string id's hash mixes its own bytes only: the same id in two chunks whose longest ids differ
    (8 and 31 bytes) hashes alike, in the passes over the ids (grouped by 262,144) and in the hashes
    taken as they are written (IdHashes, chunk by chunk)."""
    n = 1 << 18
    short = pa.array(["doc-1"] + [f"a{i:07d}" for i in range(n)])
    long = pa.array(["doc-1"] + [f"b{i:030d}" for i in range(n)])
    expected = (1, [f"duplicate id 'doc-1' in rows 0 and {n + 1}; ids must be unique"])
    ids = pa.chunked_array([short, long])
    assert id_problems(ids, "id", 1) == expected
    hashed = idcheck.IdHashes()
    for chunk in ids.chunks:
        hashed.add(chunk)
    assert id_problems(ids, "id", 1, hashed) == expected


@pytest.mark.parametrize("kind", ["int", "str", "long str"])
def test_hashes_taken_while_writing_find_what_a_dict_finds(kind: str) -> None:
    """The ids' hashes gathered chunk by chunk (IdHashes): the same count and rows as a dict."""
    rng = random.Random(kind)
    values = random_ids(rng, 20_000, "int" if kind == "int" else "str")
    if kind == "long str":
        values = [v if v is None else v * rng.choice([1, 1, 40]) for v in values]
    values[15_000] = values[3]  # at least one duplicate
    ids = chunked(rng, values)
    hashed = idcheck.IdHashes()
    for chunk in ids.chunks:
        hashed.add(chunk)
    assert hashed.rows == len(values) and hashed.usable
    assert id_problems(ids, "id", 5, hashed) == dict_id_problems(values, "id", 5)


def test_ids_in_increasing_order_are_unique_without_sorting(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ids each greater than the one before (checked chunk by chunk, across chunks too) need no sort
    of their hashes; one that is not (here the first id of a chunk equal to the last of the one
    before) sends them through the hashes, which name the duplicate."""

    def check(chunks: list[list[Any]], sort: bool) -> tuple[int, list[str]]:
        ids = pa.chunked_array([pa.array(c) for c in chunks])
        hashed = idcheck.IdHashes()
        for chunk in ids.chunks:
            hashed.add(chunk)
        taken = idcheck.IdHashes.take_sorted
        with monkeypatch.context() as m:
            m.setattr(idcheck.IdHashes, "take_sorted", lambda self: pytest.fail("sorted") if not sort else taken(self))
            return id_problems(ids, "id", 5, hashed)

    assert check([[f"q{i:08d}" for i in range(1000)], [f"q{i:08d}" for i in range(1000, 3000)]], sort=False) == (0, [])
    assert check([[1, 5, 9], [10, 11]], sort=False) == (0, [])
    assert check([["a", "b"], ["b", "c"]], sort=True) == (1, ["duplicate id 'b' in rows 1 and 2; ids must be unique"])
    assert check([["a", "c"], ["b"]], sort=True) == (0, [])
    assert check([[1, None, 3]], sort=True)[0] == 1  # a null: named, through the passes


def test_increasing_ids_are_not_hashed_and_ids_that_stop_increasing_are_still_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While the ids increase no hash is taken (they are unique without one); ids that stop increasing
    after such a chunk are checked by the pass over the column, naming the duplicate as a dict does."""
    real = idcheck._id_hashes
    hashed_chunks: list[int] = []

    def counting(chunk: Any) -> Any:
        hashed_chunks.append(len(chunk))
        return real(chunk)

    monkeypatch.setattr(idcheck, "_id_hashes", counting)
    ids = pa.chunked_array(
        [pa.array([f"q{i:08d}" for i in range(1000)]), pa.array([f"q{i:08d}" for i in range(1000, 3000)])]
    )
    hashed = idcheck.IdHashes()
    for chunk in ids.chunks:
        hashed.add(chunk)
    assert hashed_chunks == [] and id_problems(ids, "id", 5, hashed) == (0, [])
    values = ["a", "b", "c", "b", "d"]
    ids = pa.chunked_array([pa.array(values[:3]), pa.array(values[3:])])
    hashed = idcheck.IdHashes()
    for chunk in ids.chunks:
        hashed.add(chunk)
    assert not hashed.usable and hashed_chunks == []  # the first chunk went unhashed: the pass hashes all
    assert (
        id_problems(ids, "id", 5, hashed)
        == dict_id_problems(values, "id", 5)
        == (
            1,
            ["duplicate id 'b' in rows 1 and 3; ids must be unique"],
        )
    )


def test_id_check_of_other_id_types() -> None:
    import datetime as dt
    from decimal import Decimal

    day = dt.date(2024, 2, 29)
    for values, typ in [
        ([1.5, -0.0, float("nan"), 0.0, float("nan"), None, 1.5], pa.float64()),
        ([True, False, None, True], pa.bool_()),
        ([day, None, day], pa.date32()),
        (
            [dt.datetime(2024, 1, 1, 12), dt.datetime(2024, 1, 1, 12, 0, 1), dt.datetime(2024, 1, 1, 12)],
            pa.timestamp("us"),
        ),
        ([Decimal("1.50"), Decimal("2.00"), Decimal("1.50")], pa.decimal128(6, 2)),
        ([b"ab", b"cd", None, b"ab"], pa.binary(2)),
        ([b"\x00", b"\x00\x00", b"", b"", b"\x00"], pa.binary()),
        (["a", "b", "", "a", ""], pa.large_string()),
        ([3, 5, 3, None], pa.int8()),
    ]:
        ids = pa.chunked_array([pa.array(values[:2], typ), pa.array(values[2:], typ)])
        assert id_problems(ids, "k") == dict_id_problems(values, "k"), typ
    enc = pa.chunked_array([pa.array(["a", "b", None, "a"]).dictionary_encode()])
    assert id_problems(enc, "k") == dict_id_problems(["a", "b", None, "a"], "k")
    nested = pa.chunked_array([pa.array([[1, 2], [3], [1, 2], None])])  # no hash: one row at a time
    assert id_problems(nested, "k") == (
        2,
        [
            "duplicate id [1, 2] in rows 0 and 2; ids must be unique",
            "row 3: input.id_column 'k' is null or missing; every row needs an id",
        ],
    )
    assert id_problems(pa.chunked_array([pa.nulls(3)]), "k")[0] == 3
    with pytest.raises(InputError, match=r"^f: duplicate id 2.5 in rows 1 and 2; ids must be unique$"):
        check_ids("f", pa.chunked_array([[1.5, 2.5], [2.5]]))


# ---------------------------------------------------------------- bad lines


def test_a_bad_line_is_named_by_the_scan_after_pyarrow_fails(tmp_path: Path, calls: dict[str, int]) -> None:
    lines = [json.dumps(row(i)) for i in range(ROWS)]
    lines[30_000] = '{"id": "x", text}'
    p = write_lines(tmp_path / "bad.jsonl", lines)
    with pytest.raises(InputError) as e:
        converted(tmp_path, [p])
    assert str(e.value) == (
        f"{p}:30001: not valid JSON (Expecting property name enclosed in double quotes at column 13); "
        "fix or remove the line"
    )
    assert calls == {"scan": 1, "old_path": 1}


def test_invalid_utf8_that_pyarrow_would_keep_is_named(tmp_path: Path) -> None:
    data = b"".join(json.dumps(row(i)).encode() + b"\n" for i in range(ROWS))
    at = data.index(b'"row 30000')
    p = tmp_path / "latin1.jsonl"
    p.write_bytes(data[: at + 1] + b"\xe9" + data[at + 1 :])
    line_start = data.rindex(b"\n", 0, at) + 1
    with pytest.raises(InputError) as e:
        converted(tmp_path, [p])
    assert str(e.value) == (
        f"{p}:30001: invalid UTF-8 at byte {at + 1 - line_start} of the line, file offset {at + 1}; "
        "re-encode the file as UTF-8"
    )


@pytest.mark.parametrize(
    "bad, message",
    [
        # pyarrow reads these; one JSON object a line is the rule, as before
        ('{"id": "a"} {"id": "b"}', "{p}:3: not valid JSON (Extra data at column 13); fix or remove the line"),
        (
            '{"id": "a",\n "text": "x"}',
            "{p}:3: not valid JSON (Expecting property name enclosed in double quotes at column 1); fix or remove the line",
        ),
        (
            '["id", "a"]',
            '{p}:3: expected a JSON object per line, got an array; write the row as one object ({{"text": ...}}) or remove the line',
        ),
        # json.loads reads this, pyarrow refuses it (naming a row of its block): the line is named
        ('{"id": "a", "id": "b"}', "{p}:3: key 'id' appears twice in one object; remove or rename one"),
    ],
)
def test_json_one_reader_takes_and_the_other_refuses(
    tmp_path: Path, calls: dict[str, int], bad: str, message: str
) -> None:
    p = write_lines(tmp_path / "odd.jsonl", [json.dumps(row(0)), json.dumps(row(1)), bad, json.dumps(row(3))])
    with pytest.raises(InputError) as e:
        converted(tmp_path, [p])
    assert str(e.value) == message.format(p=p)
    assert calls["scan"] == 1


def test_only_blank_lines(tmp_path: Path) -> None:
    p = tmp_path / "blank.jsonl"
    p.write_bytes(b"\n  \r\n\t\n")
    with pytest.raises(InputError) as e:
        converted(tmp_path, [p])
    assert str(e.value) == f"{p}: no rows (only blank lines); there is nothing to run"


def test_count_lines(tmp_path: Path) -> None:
    p = tmp_path / "t.txt"
    for data, lines, with_content in [
        (b"", 0, 0),
        (b"a\n", 1, 1),
        (b"a", 1, 1),
        (b"a\n\n \r\n\tb", 4, 2),
        (b"\n\n", 2, 0),
        (b"a\r\nb\r\n  ", 3, 2),
    ]:
        p.write_bytes(data)
        assert (count_lines(p), count_lines(p, exact=True)) == (lines, with_content), data
    gz = tmp_path / "t.jsonl.gz"
    gz.write_bytes(gzip.compress(b"a\n\nb\n"))
    assert (count_lines(gz), count_lines(gz, exact=True)) == (3, 2)


def test_glob_of_files_is_read_in_order(tmp_path: Path, calls: dict[str, int]) -> None:
    for k in range(3):
        write_lines(tmp_path / f"part-{k}.jsonl", [json.dumps(row(i)) for i in range(k * 100, k * 100 + 100)])
    files = input_files(str(tmp_path / "part-*.jsonl"))
    ds, rows = converted(tmp_path, files)
    assert rows == 300 and ds.to_list() == [row(i) for i in range(300)] and calls == {"scan": 0, "old_path": 0}
