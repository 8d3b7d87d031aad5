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
    ],
)
def test_line_starts_are_checked_across_any_cut_between_reads(data: bytes, fits: bool) -> None:
    from batchinfer.inputs.object_lines import LineStarts, objects_only

    assert objects_only(data) is fits
    for cut in range(len(data) + 1):
        starts = LineStarts()
        assert (starts.fits(data[:cut]) and starts.fits(data[cut:])) is fits, cut


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
