"""`redo --where`: the grammar compiled to a pyarrow Expression, checked against the output's columns."""

from __future__ import annotations

import pyarrow as pa
import pytest

from batchinfer.rundir.schema import output_schema
from batchinfer.rundir.where import WhereError, compile_where

SCHEMA = output_schema(pa.string(), 1, pa.struct([("lang", pa.string())]), labels=True, confidence=True).append(
    pa.field("pass", pa.int32())
)
ROWS = [
    {"row": 0, "id": "a", "text": "x", "finish_reason": "length", "output_tokens": 8, "label_confidence": 0.9},
    {"row": 1, "id": "b", "text": "y", "finish_reason": "stop", "output_tokens": 3, "label_confidence": 0.4},
    {"row": 2, "id": "c", "error": {"kind": "overlong", "message": "too long"}, "input": {"lang": "fr"}},
    {"row": 3, "id": "d", "text": 'say "hi"', "finish_reason": "stop", "output_tokens": 12, "input": {"lang": "en"}},
    {"row": 4, "id": "e", "error": {"kind": "prompt", "message": "null field"}, "pass": 1},
]
TABLE = pa.Table.from_pylist([dict({"pass": 0}, **r) for r in ROWS], schema=SCHEMA)


def ids(expr: str) -> list[str]:
    return TABLE.filter(compile_where(expr, SCHEMA)).column("id").to_pylist()


@pytest.mark.parametrize(
    "expr, expected",
    [
        ('finish_reason == "length"', ["a"]),
        ("finish_reason != 'length'", ["b", "d"]),  # a comparison on null is false
        ('not finish_reason == "length"', ["b", "c", "d", "e"]),  # ... and `not` of it true
        ("error is not null", ["c", "e"]),
        ("error is null", ["a", "b", "d"]),
        ('error.kind == "overlong"', ["c"]),
        ("output_tokens < 10", ["a", "b"]),
        ("output_tokens <= 8 and output_tokens >= 8", ["a"]),
        ("output_tokens > 3.5", ["a", "d"]),
        ("label_confidence < 0.6", ["b"]),
        ('error.kind == "overlong" or (finish_reason == "length" and output_tokens > 5)', ["a", "c"]),
        ('not (error is null or input.lang == "fr")', ["e"]),
        ('input.lang == "en"', ["d"]),
        (r'text == "say \"hi\""', ["d"]),
        ("pass == 1", ["e"]),
        ("not not pass == 1", ["e"]),
    ],
)
def test_selects_the_rows_it_says(expr: str, expected: list[str]) -> None:
    assert ids(expr) == expected


def test_and_binds_tighter_than_or() -> None:
    assert ids('id == "a" or id == "b" and id == "c"') == ["a"]
    assert ids('(id == "a" or id == "b") and output_tokens == 3') == ["b"]


@pytest.mark.parametrize(
    "expr, position, words",
    [
        ("foo == 1", 1, ["the output has no field 'foo'", "known: row, id, text", "error.kind", "input.lang", "pass"]),
        ('error.kin == "x"', 1, ["error has no field 'kin'", "known: kind, message"]),
        (
            'error.kind.x == "a"',
            1,
            ["error.kind has no field 'x' (error.kind is a column of string values, which have no fields: compare"],
        ),
        ('output_tokens == "a"', 18, ["output_tokens holds numbers, not text", "a number"]),
        ("finish_reason == 3", 18, ["finish_reason holds text, not numbers", 'a quoted text ("length")']),
        ('error == "x"', 10, ["error holds a struct (fields kind, message)", "one of its fields"]),
        ("text ==", 8, ["expected a value after ==", "the end of the expression"]),
        ("text == null", 9, ["`== null` compares nothing", "text is null"]),
        ('(text == "a"', 13, ["expected `)`"]),
        ('text == "a" text', 13, ["expected `and`, `or` or the end, got 'text'"]),
        ("text is nul", 9, ["expected `null` after `is`"]),
        ("text = 'a'", 6, ["unexpected character '='"]),
        ("text", 5, ["expected a comparison", "or `is null` after text"]),
        ("and text == 'a'", 1, ["expected a column name", "columns: row, id"]),
        ("   ", None, ["--where is empty"]),
    ],
)
def test_errors_name_the_position_and_the_known_columns(expr: str, position: int, words: list[str]) -> None:
    with pytest.raises(WhereError) as e:
        compile_where(expr, SCHEMA)
    msg = str(e.value)
    if position is not None:
        assert msg.startswith(f"--where at character {position}:"), msg
        line, caret = msg.splitlines()[-2:]
        assert line == f"  {expr}" and caret.index("^") == position + 1  # the caret under that character
    for w in words:
        assert w in msg, msg


@pytest.mark.parametrize("literal", ["99999999999999999999999", "-9223372036854775809", "9" * 400])
def test_an_integer_past_int64_is_refused_naming_the_limit(literal: str) -> None:
    expr = f"row >= {literal}"
    with pytest.raises(WhereError) as e:  # was an OverflowError traceback from pa.scalar
        compile_where(expr, SCHEMA)
    msg = str(e.value)
    assert msg.startswith("--where at character 8:"), msg
    assert "outside the 64-bit integer range -9223372036854775808 to 9223372036854775807" in msg, msg
    assert msg.splitlines()[-1].index("^") == 9  # the caret under the literal


@pytest.mark.parametrize("literal", ["9223372036854775807", "-9223372036854775808"])
def test_the_int64_limits_themselves_compile(literal: str) -> None:
    assert ids(f"row <= {literal}") == (["a", "b", "c", "d", "e"] if literal[0] != "-" else [])


def test_an_integer_past_pythons_digit_limit_is_refused_in_one_line() -> None:
    """An integer literal of more than 4300 digits (Python's int() limit) is out of range, not a
    ValueError traceback (attack 42, B7); leading zeros do not make a number huge."""
    with pytest.raises(WhereError, match=r"9{12}\.\.\.\(5000 digits\) is outside the 64-bit integer range"):
        compile_where("row == " + "9" * 5000, SCHEMA)
    assert TABLE.filter(compile_where("row == " + "0" * 5000 + "1", SCHEMA)).column("id").to_pylist() == ["b"]
