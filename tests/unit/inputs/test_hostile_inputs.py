"""Hostile input files (issue 41, one row one verdict): each is refused by file and line or row
with what to do, or read with its values as written; nothing is changed without a word, the
process never crashes, and nothing is left behind. No engine: the readers are called directly."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Optional

import pytest

from batchinfer.errors import InputError
from batchinfer.inputs.convert import convert_input, open_input

OBJECT_PER_LINE = (
    'expected a JSON object per line, got {}; write the row as one object ({{"text": ...}}) or remove the line'
)


def convert(tmp_path: Path, files: list[Path], fmt: str = "jsonl", id_column: Optional[str] = None) -> list[dict]:
    """The rows of files as converted for a run."""
    dest = tmp_path / "input"
    convert_input(files, fmt, dest, id_column, None)
    return list(open_input(dest))


def refusal(tmp_path: Path, files: list[Path], fmt: str = "jsonl", id_column: Optional[str] = None) -> str:
    """The InputError converting files gives; nothing of the conversion is left beside dest."""
    dest = tmp_path / "input"
    with pytest.raises(InputError) as e:
        convert_input(files, fmt, dest, id_column, None)
    assert not dest.exists() and not dest.with_name("input.tmp").exists()
    return str(e.value)


def refusals_in_child(tmp_path: Path, cases: list[list[Path]], fmt: str = "jsonl") -> list[str]:
    """The InputError each case's files give, converted in one child process: a reader that crashes
    (pyarrow's segfault on a `null` line) fails the test instead of pytest itself."""
    script = textwrap.dedent(
        """
        import json, sys
        from pathlib import Path
        from batchinfer.errors import InputError
        from batchinfer.inputs.convert import convert_input
        out = []
        for k, files in enumerate(json.loads(sys.argv[1])):
            try:
                convert_input([Path(f) for f in files], sys.argv[2], Path(sys.argv[3]) / f"input-{k}", None, None)
                out.append("read without error")
            except InputError as e:
                out.append(str(e))
        print(json.dumps(out))
        """
    )
    arg = json.dumps([[str(f) for f in files] for files in cases])
    done = subprocess.run(
        [sys.executable, "-c", script, arg, fmt, str(tmp_path)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"the child died (exit {done.returncode}): {done.stderr[-2000:]}"
    return json.loads(done.stdout)


def lines(path: Path, *rows: Any) -> Path:
    """path holding one line per row: a str as written, anything else as its JSON."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


# ---------------------------------------------------------------- JSON lines that are not one object a line


def test_a_null_line_where_pyarrow_starts_a_block_is_refused_not_a_crash(tmp_path: Path) -> None:
    """pyarrow's JSON reader segfaults on a block that starts with `null`: the first line of the
    first file (its type inference), and the first line of a later file (the stream)."""
    good = lines(tmp_path / "good.jsonl", *({"text": f"row {i}"} for i in range(3)))
    first = lines(tmp_path / "first.jsonl", "null", {"text": "a"})
    spaced = lines(tmp_path / "spaced.jsonl", "  null", {"text": "a"})
    assert refusals_in_child(tmp_path, [[first], [good, first], [spaced]]) == [
        f"{first}:1: " + OBJECT_PER_LINE.format("null"),
        f"{first}:1: " + OBJECT_PER_LINE.format("null"),
        f"{spaced}:1: " + OBJECT_PER_LINE.format("null"),
    ]


@pytest.mark.parametrize(
    ("line", "kind"), [("null", "null"), ("5", "a number"), ('"s"', "a string"), ("[1]", "an array"), ("true", "true")]
)
def test_a_line_that_is_no_object_is_refused_by_line(tmp_path: Path, line: str, kind: str) -> None:
    p = lines(tmp_path / "c.jsonl", {"text": "a"}, line, {"text": "b"})
    assert refusal(tmp_path, [p]) == f"{p}:2: " + OBJECT_PER_LINE.format(kind)


@pytest.mark.parametrize(
    ("data", "fits"),
    [
        (b'{"a": 1}\n\n  \r\n\t{"b": [null]}\n{"c": "null"}', True),
        (b'\xef\xbb\xbf{"a": 1}\n', True),
        (b'{"a": 1}\n   \t null\n', False),
        (b'{"a": 1}\n{"b": 2} null\n', True),  # not at a line's start: pyarrow makes two rows, the line count tells
        (b"  \n 5\n", False),
        (b'{"a": 1}\n"s"', False),
        (b'{"a": 1}\n{"b": 2}\n{"c": 3}\n', True),  # what good input is: counted, never searched
        (b'{"a": 1}\n{"b": 2}\nnull\n{"c": 3}', False),
        (b'{"a": 1}\n{"b": 2}\n {"c": 3}', True),
    ],
)
def test_line_starts_are_checked_across_any_cut_between_reads(data: bytes, fits: bool) -> None:
    from batchinfer.inputs.object_lines import LineStarts, objects_only

    assert objects_only(data) is fits
    lines = data.count(b"\n") + (not data.endswith(b"\n"))  # what count_lines says of such a file
    for cut in range(len(data) + 1):
        starts = LineStarts()
        assert (starts.fits(data[:cut]) and starts.fits(data[cut:])) is fits, cut
        if fits:  # the lines counted on the way, as the stream's line count
            assert starts.lines == lines, cut


# ---------------------------------------------------------------- a row's own sampling values


def test_keys_other_rows_have_are_no_unknown_sampling_keys(tmp_path: Path) -> None:
    """Rows of two files with different sampling keys are read as one struct holding every key, null
    where a row lacks it: those nulls are not the row's keys (only the row that has `foo` is refused)."""
    from batchinfer.config.compose import compose
    from batchinfer.config.schema import to_config
    from batchinfer.requests.build import row_sampling
    from batchinfer.requests.prompts import RowError

    a = lines(tmp_path / "a.jsonl", {"text": "a", "params": {"temperature": 0.5}})
    b = lines(
        tmp_path / "b.jsonl",
        {"text": "b", "params": {"top_p": 0.5, "structured_outputs": {"choice": ["x", "y"]}}},
        {"text": "c", "params": {"foo": 1, "structured_outputs": {"regex": "[a-z]+"}}},
    )
    rows = convert(tmp_path, [a, b])
    assert rows[0]["params"]["top_p"] is None and rows[0]["params"]["foo"] is None  # the struct's nulls
    cfg = to_config(compose(["input.sampling_column=params"]))
    assert json.loads(row_sampling(cfg, rows[0], 0)) == {"temperature": 0.5}
    assert json.loads(row_sampling(cfg, rows[1], 1)) == {"top_p": 0.5, "structured_outputs": {"choice": ["x", "y"]}}
    with pytest.raises(RowError) as e:
        row_sampling(cfg, rows[2], 2)
    assert e.value.message == "field 'params' has unknown sampling keys ['foo']"


@pytest.mark.parametrize("literal", ["1e400", "Infinity", "-Infinity", "NaN"])
def test_a_number_json_text_cannot_hold_in_a_json_text_column_is_refused_not_made_null(
    tmp_path: Path, literal: str
) -> None:
    """Sampling objects whose keys differ are kept as JSON text (`datasets`' Json), which wrote these
    as null: the row's temperature was dropped without a word."""
    p = lines(
        tmp_path / "c.jsonl",
        {"text": "a", "params": {"top_p": 0.5, "max_tokens": 3}},
        f'{{"text": "b", "params": {{"temperature": {literal}}}}}',
    )
    assert refusal(tmp_path, [p]) == (
        f"{p}:2: column 'params' (kept as JSON text: its objects' keys differ from row to row) holds the number "
        f'{literal}, which JSON text cannot hold: it would be read as null; write it as a JSON string ("{literal}") '
        "or a finite number"
    )


def test_nan_where_a_column_holds_floats_is_kept(tmp_path: Path) -> None:
    p = lines(tmp_path / "c.jsonl", '{"text": "a", "x": NaN}', '{"text": "b", "x": 0.5}')
    rows = convert(tmp_path, [p])
    assert rows[0]["x"] != rows[0]["x"] and rows[1]["x"] == 0.5


# ---------------------------------------------------------------- integers beyond 64 bits

BIG = 2**64 + 1


@pytest.mark.parametrize(
    ("first", "second", "column", "value"),
    [
        ('{"x": 1}', '{"x": %d}', "x", BIG),
        ('{"x": {"y": 1}}', '{"x": {"y": %d}}', "x.y", BIG),
        ('{"x": [1]}', '{"x": [1, %d]}', "x", BIG),
        ('{"x": 1}', '{"x": %d}', "x", 2**63),  # just past int64: pyarrow reads it as a float too
        ('{"x": 1}', '{"x": %d}', "x", -(2**63) - 1),
        ('{"x": %d}', '{"x": 2}', "x", BIG),  # in the first row
    ],
)
def test_an_integer_beyond_64_bits_is_refused_naming_line_and_column(
    tmp_path: Path, first: str, second: str, column: str, value: int
) -> None:
    """pyarrow reads such a column as floats: 1 became 1.0 and the big one lost its digits."""
    p = lines(tmp_path / "c.jsonl", first.replace("%d", str(value)), second.replace("%d", str(value)))
    line = 1 if "%d" in first else 2
    assert refusal(tmp_path, [p]) == (
        f"{p}:{line}: column {column!r} holds the integer {value}, beyond 64 bits: the column would be read as "
        f'floats ({value} as {float(value)!r}); write such numbers as JSON strings ("{value}")'
    )


def test_big_floats_and_big_integers_as_text_are_kept(tmp_path: Path) -> None:
    p = lines(tmp_path / "c.jsonl", {"text": "a", "x": 1e19, "s": str(BIG)}, {"text": "b", "x": -2.5e300, "s": "1"})
    assert convert(tmp_path, [p]) == [{"text": "a", "x": 1e19, "s": str(BIG)}, {"text": "b", "x": -2.5e300, "s": "1"}]


def test_a_json_document_integer_beyond_64_bits_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "c.json"
    p.write_text(f'[{{"text": "a", "x": 1}},\n {{"text": "b", "x": {2**63 + 1}}}]\n')
    assert refusal(tmp_path, [p], "json") == (
        f"{p}:2: column 'x' holds the integer {2**63 + 1}, beyond 64 bits: the column would be read as floats "
        f'({2**63 + 1} as {float(2**63 + 1)!r}); write such numbers as JSON strings ("{2**63 + 1}")'
    )


# ---------------------------------------------------------------- JSON documents that are no list of rows

NOT_ROWS = 'not rows: a JSON input is an array (one object per row, [{"text": ...}, ...]) or one object per line'


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("5\n", "{p}:1: the document is a number, " + NOT_ROWS),
        ('\n  "abc"\n', "{p}:2: the document is a string, " + NOT_ROWS),
        ("null\n", "{p}:1: the document is null, " + NOT_ROWS),
        (
            '[{"id": 1, "text": "a"},\n 5]\n',
            "{p}:2: item 1 of the array is a number; its items must all be objects (one per row), as the first is: "
            "fix or remove that item",
        ),
        (
            '[{"text": "a"},\n\n null]\n',
            "{p}:3: item 1 of the array is null; its items must all be objects (one per row), as the first is: "
            "fix or remove that item",
        ),
        (
            '["a", {"text": "b"}]',
            "{p}:1: item 1 of the array is an object; its items must all be strings (the text of each row), as the "
            "first is: fix or remove that item",
        ),
        ('{"text": "a"}\nnull\n', "{p}:2: " + OBJECT_PER_LINE.format("null")),
        (
            "[" * 10000 + "]" * 10000,
            "{p}:1: objects and lists nested more than 63 levels deep (the row's own object counts as one); at most "
            "63 can be read: flatten the value or write it as JSON text (a quoted string)",
        ),
        (
            '[{"text": "a"},\n{"text": "b", "x": ' + "[" * 100 + "]" * 100 + "}]",
            "{p}:2: objects and lists nested more than 63 levels deep (the row's own object counts as one); at most "
            "63 can be read: flatten the value or write it as JSON text (a quoted string)",
        ),
        (
            '[{"text": "a", "x": NaN}]',
            "{p}:1: the document (whose rows are read through JSON text) holds the number NaN, which JSON text cannot "
            'hold: it would be read as null; write it as a JSON string ("NaN") or a finite number',
        ),
    ],
)
def test_a_json_document_that_is_no_list_of_rows_is_refused_by_line(tmp_path: Path, text: str, message: str) -> None:
    p = tmp_path / "c.json"
    p.write_text(text)
    [got] = refusals_in_child(tmp_path, [[p]], "json")  # a null item crashed the process
    assert got == message.replace("{p}", str(p))


def test_json_documents_of_rows_are_read(tmp_path: Path) -> None:
    p = tmp_path / "c.json"
    p.write_text('[{"text": "a"},\n {"text": "b"}]')
    assert convert(tmp_path, [p], "json") == [{"text": "a"}, {"text": "b"}]
    p.write_text('["a", "b"]')
    assert convert(tmp_path / "s", [p], "json") == [{"text": "a"}, {"text": "b"}]
    p.write_text('{"text": "a"}\n{"text": "b"}\n')
    assert convert(tmp_path / "l", [p], "json") == [{"text": "a"}, {"text": "b"}]


# ---------------------------------------------------------------- ids

ID_HINT = "an id is one string or number: give every row such an id, or set input.id_column to another column (unset, rows are numbered)"


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([{"a": 1}, {"a": 2}], "row 0: input.id_column 'id' is an object ({\"a\": 1})"),
        ([[1], [2]], "row 0: input.id_column 'id' is an array ([1])"),
        ([None, False, True], "row 1: input.id_column 'id' is true/false (false)"),
        (["a", 2, {"b": 1}], "row 2: input.id_column 'id' is an object ({\"b\":1})"),  # kept as JSON text
        (["a", 2, [3]], "row 2: input.id_column 'id' is an array ([3])"),
    ],
)
def test_an_id_that_is_no_single_value_is_refused_naming_the_row(tmp_path: Path, ids: list, message: str) -> None:
    p = lines(tmp_path / "c.jsonl", *({"id": i, "text": "t"} for i in ids))
    assert refusal(tmp_path, [p], id_column="id") == f"{p}: {message}; {ID_HINT}"


def test_ids_of_strings_beside_integers_are_refused(tmp_path: Path) -> None:
    """Kept as JSON text, they made the worker's commit fail the shard on every attempt (one id type
    per output column)."""
    p = lines(tmp_path / "c.jsonl", {"id": "a", "text": "t"}, {"id": 2, "text": "u"})
    assert refusal(tmp_path, [p], id_column="id") == (
        f"{p}: row 1: input.id_column 'id' is the number 2 but row 0's is the string \"a\": an id column holds "
        'one type; write every id as a JSON string ("2"), or every id as a number'
    )


def test_a_bool_id_column_of_parquet_is_refused(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "c.parquet"
    pq.write_table(pa.table({"id": [True, False], "text": ["a", "b"]}), p)
    assert (
        refusal(tmp_path, [p], "parquet", "id") == f"{p}: row 0: input.id_column 'id' is true/false (true); {ID_HINT}"
    )


# ---------------------------------------------------------------- CSV


@pytest.mark.parametrize("sep", [",", "\t"])
def test_an_empty_csv_id_cell_is_a_null_id(tmp_path: Path, sep: str) -> None:
    p = tmp_path / ("c.tsv" if sep == "\t" else "c.csv")
    p.write_text(f"id{sep}text\n1{sep}a\n{sep}b\n")
    fmt = "tsv" if sep == "\t" else "csv"
    assert (
        refusal(tmp_path, [p], fmt, "id")
        == f"{p}: row 1: input.id_column 'id' is null or missing; every row needs an id"
    )


def test_empty_cells_elsewhere_and_null_like_ids_stay_text(tmp_path: Path) -> None:
    p = tmp_path / "c.csv"
    p.write_text("id,text\nNA,\nnull,b\n")
    assert convert(tmp_path, [p], "csv", "id") == [{"id": "NA", "text": ""}, {"id": "null", "text": "b"}]


CELLS = "(a record must have one cell per column); quote a cell holding ',' or a newline, or fix the record"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        # pandas took the first column as an index: every value one column left, without a word
        ("id,text\n1,a,b\n2,c,d\n", "{p}:2: 3 cells but the header names 2 columns " + CELLS),
        ("id,text\n1,a\n2,b,c\n", "{p}:3: 3 cells but the header names 2 columns " + CELLS),
        ('id,text\n1,"a\nb"\n\n2,c,d\n', "{p}:5: 3 cells but the header names 2 columns " + CELLS),
        # pandas filled the missing cell with ''
        ("id,text\n1,a\n2\n", "{p}:3: 1 cell but the header names 2 columns " + CELLS),
        (
            "id,text,\n1,a,b\n",
            "{p}:1: column 3 of the header has no name (a header ending in ',' makes an empty last one); name every column",
        ),
        ("id,,text\n1,a,b\n", "{p}:1: column 2 of the header has no name; name every column"),
    ],
)
def test_a_csv_record_that_does_not_fit_the_header_is_refused_by_line(tmp_path: Path, text: str, message: str) -> None:
    p = tmp_path / "c.csv"
    p.write_text(text)
    assert refusal(tmp_path, [p], "csv") == message.replace("{p}", str(p))


def test_csv_records_with_quoted_separators_and_newlines_are_read(tmp_path: Path) -> None:
    p = tmp_path / "c.csv"
    p.write_bytes(b'\xef\xbb\xbfid,text\r\n1,"a, b"\r\n\r\n2,"c\nd"\r\n')
    assert convert(tmp_path, [p], "csv", "id") == [{"id": "1", "text": "a, b"}, {"id": "2", "text": "c\nd"}]


# ---------------------------------------------------------------- compressed files cut short


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "json"])
def test_a_zstd_file_cut_short_is_refused_not_read_as_a_shorter_corpus(tmp_path: Path, fmt: str) -> None:
    """zstandard's stream reader ended quietly where the bytes did: whole lines, a shorter corpus."""
    import zstandard

    rows = [{"id": i, "text": f"row {i} " + "word " * 20} for i in range(20000)]
    if fmt == "jsonl":
        data = "".join(json.dumps(r) + "\n" for r in rows)
    elif fmt == "csv":
        data = "id,text\n" + "".join(f"{r['id']},{r['text']}\n" for r in rows)
    else:
        data = json.dumps(rows)
    packed = zstandard.ZstdCompressor().compress(data.encode())
    p = tmp_path / f"c.{fmt}.zst"
    p.write_bytes(packed[: len(packed) // 2])
    assert refusal(tmp_path, [p], fmt, "id") == (
        f"{p}: cannot be decompressed as zst (the file ends inside a zstd frame); the file is cut short, corrupt or "
        "not zst data: copy it again, or rename it without .zst if it is not compressed"
    )
