"""The explicit Arrow schema of output rows, fixed once per run in run.yaml."""

from __future__ import annotations

import base64
import json
import re
from typing import Any, Optional, TypedDict

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

ERROR_TYPE = pa.struct([("kind", pa.string()), ("message", pa.string())])
# Every row the engine answered carries its request's digest (requests/digest.py, hex); `reused`
# says the answer was an output.reuse directory's. Run directories made before have neither.
DIGEST_COLUMN = "request_digest"
REUSED_COLUMN = "reused"
REUSE_FIELDS = (pa.field(DIGEST_COLUMN, pa.string()), pa.field(REUSED_COLUMN, pa.bool_()))


class ErrorCell(TypedDict):
    """An error row's `error` column (ERROR_TYPE)."""

    kind: str
    message: str


class OutputRow(TypedDict, total=False):
    """One output row as the worker builds it, by column (output_schema, pooling_schema): rows_to_table
    makes a part of them, a column the row lacks null."""

    row: int
    id: Any  # the input's id column's type
    text: Optional[str]
    samples: list[str]
    reasoning: Optional[str]
    label: Optional[str]
    label_confidence: float
    finish_reason: Optional[str]
    prompt_tokens: Optional[int]
    output_tokens: int
    error: Optional[ErrorCell]
    input: dict[str, Any]  # the carried input columns (input.columns), by name
    embedding: Any  # a float32 vector
    probs: Any
    score: float
    request_digest: str
    reused: bool


def output_schema(
    id_type: pa.DataType,
    n: int,
    input_type: Optional[pa.StructType],
    reasoning: bool = False,
    labels: bool = False,
    confidence: bool = False,
    adapter: bool = False,
) -> pa.Schema:
    """Output columns: row, id, text, [samples], [reasoning], [label, [label_confidence]], [adapter],
    finish_reason, tokens, error, [input], request_digest, reused."""
    fields = [
        pa.field("row", pa.int64(), nullable=False),
        pa.field("id", id_type),
        pa.field("text", pa.string()),
    ]
    if n > 1:
        fields.append(pa.field("samples", pa.list_(pa.string())))
    if reasoning:
        fields.append(pa.field("reasoning", pa.string()))
    if labels:
        fields.append(pa.field("label", pa.string()))
        if confidence:
            fields.append(pa.field("label_confidence", pa.float64()))
    if adapter:
        fields.append(pa.field("adapter", pa.string()))
    fields += [
        pa.field("finish_reason", pa.string()),
        pa.field("prompt_tokens", pa.int32()),
        pa.field("output_tokens", pa.int32()),
        pa.field("error", ERROR_TYPE),
    ]
    if input_type is not None:
        fields.append(pa.field("input", input_type))
    return pa.schema(fields + list(REUSE_FIELDS))


def pooling_schema(
    task: str, id_type: pa.DataType, input_type: Optional[pa.StructType], dim: Optional[int] = None
) -> pa.Schema:
    """Output columns of a pooling task: row, id, then embedding (fixed-size float32) | label and
    probs | score, prompt_tokens, error, [input], request_digest, reused; nothing is generated, so
    no text or finish reason."""
    fields = [pa.field("row", pa.int64(), nullable=False), pa.field("id", id_type)]
    if task == "embed":
        fields.append(pa.field("embedding", pa.list_(pa.float32(), dim)))
    elif task == "classify":
        fields += [pa.field("label", pa.string()), pa.field("probs", pa.list_(pa.float32()))]
    elif task == "score":
        fields.append(pa.field("score", pa.float32()))
    else:
        raise ValueError(f"not a pooling task: {task}")
    fields += [pa.field("prompt_tokens", pa.int32()), pa.field("error", ERROR_TYPE)]
    if input_type is not None:
        fields.append(pa.field("input", input_type))
    return pa.schema(fields + list(REUSE_FIELDS))


def schema_to_text(schema: pa.Schema) -> str:
    """Serialize a schema for run.yaml (Arrow IPC, base64)."""
    return base64.b64encode(schema.serialize().to_pybytes()).decode()


def schema_from_text(text: str) -> pa.Schema:
    """Read a schema written by schema_to_text."""
    return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(text)))


def schema_summary(schema: pa.Schema) -> dict[str, str]:
    """Readable column -> type map, for people reading run.yaml."""
    return {f.name: str(f.type) for f in schema}


def error_row(row: int, id_: Any, kind: str, message: str, prompt_tokens: Optional[int] = None) -> OutputRow:
    """An output row for a row that produced no text."""
    return {
        "row": row,
        "id": id_,
        "text": None,
        "finish_reason": None,
        "prompt_tokens": prompt_tokens,
        "output_tokens": 0,
        "error": {"kind": kind, "message": message},
    }


def rows_to_table(rows: list[OutputRow], schema: pa.Schema) -> pa.Table:
    """Rows as a table of exactly the run's schema (absent optional columns are null)."""
    return pa.Table.from_pylist(rows, schema=schema)


def table_to_jsonl(table: pa.Table) -> bytes:
    """JSON lines of a table, one object per row, in schema column order (types as in wire_type)."""
    if any(_needs_wire(f.type) for f in table.schema):
        table = pa.table(
            [_column(c, f.type, _to_wire) for c, f in zip(table.columns, table.schema, strict=True)], table.column_names
        )
    lines = [json.dumps(r, ensure_ascii=False, default=str) for r in table.to_pylist()]
    return ("\n".join(lines) + "\n").encode() if lines else b""


def jsonl_to_table(data: bytes, schema: pa.Schema) -> pa.Table:
    """Parse JSON lines written by table_to_jsonl back into the run's schema, value for value."""
    rows = [json.loads(line) for line in data.splitlines() if line.strip()]
    if not any(_needs_wire(f.type) for f in schema):
        return pa.Table.from_pylist(rows, schema=schema)
    wire = pa.schema([f.with_type(wire_type(f.type)) for f in schema], metadata=schema.metadata)
    table = pa.Table.from_pylist(rows, schema=wire)
    columns = [_column(c, f.type, _from_wire) for c, f in zip(table.columns, schema, strict=True)]
    return pa.Table.from_arrays(columns, schema=schema)


def jsonl_columns(data: bytes, schema: pa.Schema, columns: list[str]) -> pa.Table:
    """Some columns of JSON lines written by table_to_jsonl, parsed by pyarrow's reader (no Python
    object per row); lines it cannot read (NaN, a line over 2 GiB) go the exact way, jsonl_to_table."""
    import pyarrow.json as pj

    wanted = pa.schema([schema.field(c) for c in columns])
    if not any(_needs_wire(f.type) for f in wanted):
        try:
            table = pj.read_json(
                pa.py_buffer(data),
                read_options=pj.ReadOptions(block_size=min(max(len(data), 1 << 20) + 1, 2**31 - 1)),
                parse_options=pj.ParseOptions(explicit_schema=wanted, unexpected_field_behavior="ignore"),
            )
            return table.select(columns).cast(wanted)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            pass
    return jsonl_to_table(data, schema).select(columns)


# JSON has strings, numbers, bools, lists and objects: Arrow types without a JSON counterpart
# travel as text (or a number) that pyarrow casts back exactly, in the forms pandas and
# Python's fromisoformat read: dates and times ISO 8601, timestamps ISO 8601 with the column's
# fractional digits and, when it has a time zone, the local time and its offset; decimals as
# strings (floats would round); binary as base64; durations as integers in the column's unit.
def wire_type(typ: pa.DataType) -> pa.DataType:
    """The type a column has in JSON lines (strings for dates, timestamps, decimals, binary...)."""
    t = pa.types
    if t.is_dictionary(typ):
        return wire_type(typ.value_type)
    if t.is_map(typ):
        return pa.list_(pa.struct([("key", wire_type(typ.key_type)), ("value", wire_type(typ.item_type))]))
    if t.is_struct(typ):
        return pa.struct([f.with_type(wire_type(f.type)) for f in typ])
    if t.is_list(typ) or t.is_large_list(typ) or t.is_fixed_size_list(typ):
        item = typ.value_field.with_type(wire_type(typ.value_type))
        if t.is_fixed_size_list(typ):
            return pa.list_(item, typ.list_size)
        return pa.large_list(item) if t.is_large_list(typ) else pa.list_(item)
    if t.is_duration(typ):
        return pa.int64()
    if _is_text_leaf(typ):
        return pa.string()
    return typ


def _is_text_leaf(typ: pa.DataType) -> bool:
    t = pa.types
    return (
        t.is_temporal(typ)
        and not t.is_duration(typ)
        or t.is_decimal(typ)
        or t.is_binary(typ)
        or t.is_large_binary(typ)
        or t.is_fixed_size_binary(typ)
        or t.is_binary_view(typ)
    )


def _needs_wire(typ: pa.DataType) -> bool:
    return wire_type(typ) != typ


def _column(col: pa.ChunkedArray, typ: pa.DataType, convert: Any) -> pa.ChunkedArray:
    chunks = [convert(chunk, typ) for chunk in col.chunks]
    return pa.chunked_array(chunks, type=chunks[0].type if chunks else _empty_type(typ, convert))


def _empty_type(typ: pa.DataType, convert: Any) -> pa.DataType:
    return wire_type(typ) if convert is _to_wire else typ


def _nested(arr: pa.Array, typ: pa.DataType, convert: Any) -> Optional[pa.Array]:
    """Nested arrays rebuilt around their converted children (None for a leaf). Children are
    converted on their own: a cast of a whole struct would also parse the filler of null rows."""
    t = pa.types
    mask = arr.is_null() if arr.null_count else None
    if t.is_struct(typ):
        children = [convert(child, f.type) for child, f in zip(arr.flatten(), typ, strict=True)]
        fields = [f.with_type(c.type) for c, f in zip(children, typ, strict=True)]
        return pa.StructArray.from_arrays(children, fields=fields, mask=mask)
    if t.is_map(typ):  # offsets index the whole child arrays, also in a slice
        keys = convert(arr.values.field(0), typ.key_type)
        items = convert(arr.values.field(1), typ.item_type)
        if convert is _from_wire:
            return pa.MapArray.from_arrays(_offsets(arr), keys, items, type=typ, mask=mask)
        entries = pa.StructArray.from_arrays([keys, items], fields=list(wire_type(typ).value_type))
        return pa.ListArray.from_arrays(_offsets(arr), entries, type=wire_type(typ), mask=mask)
    if t.is_list(typ) or t.is_large_list(typ):
        values = convert(arr.values, typ.value_type)
        out_type = typ if convert is _from_wire else wire_type(typ)
        cls = pa.LargeListArray if t.is_large_list(typ) else pa.ListArray
        return cls.from_arrays(_offsets(arr), values, type=out_type, mask=mask)
    if t.is_fixed_size_list(typ):
        size = typ.list_size
        values = arr.values[arr.offset * size : (arr.offset + len(arr)) * size]
        if mask is not None:  # a null list still holds `size` filler values (""), never to be parsed
            hidden = pa.array(np.repeat(mask.to_numpy(zero_copy_only=False), size))
            values = pc.if_else(hidden, pa.scalar(None, values.type), values)
        values = convert(values, typ.value_type)
        out_type = typ if convert is _from_wire else wire_type(typ)
        return pa.FixedSizeListArray.from_arrays(values, type=out_type, mask=mask)
    return None


def _offsets(arr: pa.Array) -> pa.Array:
    # A sliced array's offsets are a slice too, which from_arrays refuses together with a mask.
    return pa.array(arr.offsets.to_numpy(), arr.offsets.type)


_OFFSET = re.compile(r"([+-]\d\d)(\d\d)$")


def _to_wire(arr: pa.Array, typ: pa.DataType) -> pa.Array:
    if not _needs_wire(typ):
        return arr
    t = pa.types
    if t.is_dictionary(typ):
        return _to_wire(arr.dictionary_decode(), typ.value_type)
    nested = _nested(arr, typ, _to_wire)
    if nested is not None:
        return nested
    if t.is_timestamp(typ):
        fmt = "%Y-%m-%dT%H:%M:%S" + ("%z" if typ.tz else "")  # %S carries the unit's fraction
        text = pc.strftime(arr, format=fmt)
        # strftime's %z is +0900; ISO 8601's extended form (and pyarrow's own cast back) is +09:00.
        return pc.replace_substring_regex(text, _OFFSET.pattern, r"\1:\2") if typ.tz else text
    if t.is_duration(typ):
        return arr.cast(pa.int64())
    if t.is_binary(typ) or t.is_large_binary(typ) or t.is_fixed_size_binary(typ) or t.is_binary_view(typ):
        # No base64 kernel in pyarrow.compute: encode the values themselves.
        return pa.array([None if v is None else base64.b64encode(v).decode() for v in arr.to_pylist()], pa.string())
    return arr.cast(pa.string())  # dates, times and decimals: ISO 8601 / exact decimal text


def _from_wire(arr: pa.Array, typ: pa.DataType) -> pa.Array:
    if not _needs_wire(typ):
        return arr
    t = pa.types
    if t.is_dictionary(typ):
        return _from_wire(arr, typ.value_type).cast(typ)
    nested = _nested(arr, typ, _from_wire)
    if nested is not None:
        return nested
    if t.is_time(typ):  # no string -> time cast: read it as a time of day on 1970-01-01
        unit = typ.unit
        day = pc.binary_join_element_wise("1970-01-01T", arr, "")
        return day.cast(pa.timestamp(unit)).cast(typ)
    if t.is_binary(typ) or t.is_large_binary(typ) or t.is_fixed_size_binary(typ) or t.is_binary_view(typ):
        raw = [None if v is None else base64.b64decode(v) for v in arr.to_pylist()]
        return pa.array(raw, pa.binary()).cast(typ)
    return arr.cast(typ)  # dates, timestamps (ISO 8601, offsets), decimals, durations (integers)
