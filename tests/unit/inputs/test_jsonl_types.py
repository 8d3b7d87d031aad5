"""JSONL parts and outputs keep every Arrow type the input readers produce, value for value."""

from __future__ import annotations

import base64
import datetime as dt
import json
from decimal import Decimal
from typing import Any

import pyarrow as pa
import pytest
from support.corpus import TIMESTAMP

from batchinfer.rundir.schema import jsonl_to_table, table_to_jsonl

UTC = dt.timezone.utc

# type, values (one null each), the JSON text of the first value
CASES: list[tuple[pa.DataType, list[Any], Any]] = [
    (pa.date32(), [dt.date(2024, 2, 29), None, dt.date(1, 1, 1)], "2024-02-29"),
    (pa.date64(), [dt.date(2024, 2, 29), None], "2024-02-29"),
    (pa.timestamp("s"), [TIMESTAMP.replace(microsecond=0), None], "2024-02-29T23:59:58"),
    (pa.timestamp("ms"), [TIMESTAMP.replace(microsecond=123000), None], "2024-02-29T23:59:58.123"),
    (pa.timestamp("us"), [TIMESTAMP, None, dt.datetime(1900, 1, 1)], "2024-02-29T23:59:58.123456"),
    (pa.timestamp("ns"), [1_709_251_198_123_456_789, None], "2024-02-29T23:59:58.123456789"),
    (pa.timestamp("us", tz="UTC"), [TIMESTAMP.replace(tzinfo=UTC), None], "2024-02-29T23:59:58.123456+00:00"),
    (pa.timestamp("ms", tz="Asia/Tokyo"), [dt.datetime(2024, 1, 1, tzinfo=UTC), None], "2024-01-01T09:00:00.000+09:00"),
    (pa.timestamp("s", tz="-05:30"), [dt.datetime(2024, 1, 1, tzinfo=UTC), None], "2023-12-31T18:30:00-05:30"),
    (pa.time32("s"), [dt.time(1, 2, 3), None], "01:02:03"),
    (pa.time64("us"), [dt.time(1, 2, 3, 456789), None], "01:02:03.456789"),
    (pa.duration("ms"), [dt.timedelta(seconds=1.5), None], 1500),
    (pa.decimal128(12, 4), [Decimal("12345678.9000"), None, Decimal("-0.0001")], "12345678.9000"),
    (pa.decimal256(40, 2), [Decimal("1" * 38 + ".25"), None], "1" * 38 + ".25"),
    (pa.binary(), [b"\x00\xffnot utf-8\n", None, b""], base64.b64encode(b"\x00\xffnot utf-8\n").decode()),
    (pa.large_binary(), [b"\x80abc", None], "gGFiYw=="),
    (pa.binary(3), [b"abc", None], "YWJj"),
    (pa.string(), ["plain", None], "plain"),
    (pa.dictionary(pa.int32(), pa.string()), ["a", None, "a"], "a"),
    (
        pa.map_(pa.string(), pa.date32()),
        [[("k", dt.date(2024, 1, 2))], None, []],
        [{"key": "k", "value": "2024-01-02"}],
    ),
]

NESTED = pa.struct(
    [
        ("when", pa.timestamp("us", tz="UTC")),
        ("days", pa.list_(pa.date32())),
        ("blobs", pa.large_list(pa.binary())),
        ("money", pa.list_(pa.decimal128(8, 2), 2)),
        ("inner", pa.struct([("d", pa.date32()), ("b", pa.binary())])),
    ]
)
NESTED_VALUES = [
    {
        "when": TIMESTAMP.replace(tzinfo=UTC),
        "days": [dt.date(2024, 1, 2), None],
        "blobs": [b"\x01\x02", None, b""],
        "money": [Decimal("1.50"), None],
        "inner": {"d": dt.date(2000, 1, 1), "b": b"\xfe"},
    },
    None,
    {"when": None, "days": None, "blobs": [], "money": None, "inner": None},
    {
        "when": None,
        "days": [],
        "blobs": None,
        "money": [Decimal("0.00"), Decimal("-3.10")],
        "inner": {"d": None, "b": None},
    },
]


def _table(typ: pa.DataType, values: list[Any]) -> pa.Table:
    schema = pa.schema([pa.field("row", pa.int64(), nullable=False), ("v", typ)])
    return pa.table({"row": list(range(len(values))), "v": pa.array(values, typ)}, schema=schema)


@pytest.mark.parametrize(("typ", "values", "shown"), CASES, ids=[str(c[0]) for c in CASES])
def test_round_trip_and_json_form(typ: pa.DataType, values: list[Any], shown: Any) -> None:
    table = _table(typ, values)
    data = table_to_jsonl(table)
    assert json.loads(data.splitlines()[0])["v"] == shown
    assert json.loads(data.splitlines()[1])["v"] is None
    back = jsonl_to_table(data, table.schema)
    assert back.schema == table.schema and back.equals(table)
    # A slice (merge writes files of at most N rows) and a list of and a struct around the type.
    assert jsonl_to_table(table_to_jsonl(table.slice(1)), table.schema).equals(table.slice(1).combine_chunks())
    wrapped = pa.struct([("x", typ), ("xs", pa.list_(typ))])
    nested = _table(wrapped, [{"x": v, "xs": [v, None]} for v in values] + [None])
    assert jsonl_to_table(table_to_jsonl(nested), nested.schema).equals(nested)


def test_nested_round_trip_with_nulls_at_every_level() -> None:
    table = _table(NESTED, NESTED_VALUES)
    for t in (table, table.slice(1, 3), pa.concat_tables([table, table])):
        back = jsonl_to_table(table_to_jsonl(t), t.schema)
        assert back.equals(t.combine_chunks()), back
    first = json.loads(table_to_jsonl(table).splitlines()[0])["v"]
    assert first["days"] == ["2024-01-02", None] and first["blobs"] == ["AQI=", None, ""]
    assert first["money"] == ["1.50", None] and first["inner"] == {"d": "2000-01-01", "b": "/g=="}


def test_empty_table_and_plain_types_unchanged() -> None:
    schema = pa.schema([("d", pa.date32()), ("n", pa.float64()), ("s", pa.list_(pa.string()))])
    assert table_to_jsonl(schema.empty_table()) == b""
    assert jsonl_to_table(b"", schema).equals(schema.empty_table())
    plain = pa.table({"n": [1.5, None], "s": [["a"], None]})
    assert table_to_jsonl(plain) == b'{"n": 1.5, "s": ["a"]}\n{"n": null, "s": null}\n'
