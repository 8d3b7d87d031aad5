"""The explicit Arrow schema of output rows, fixed once per run in run.yaml."""

from __future__ import annotations

import base64
import json
from typing import Any, Optional

import pyarrow as pa

ERROR_TYPE = pa.struct([("kind", pa.string()), ("message", pa.string())])


def output_schema(
    id_type: pa.DataType,
    n: int,
    input_type: Optional[pa.StructType],
    reasoning: bool = False,
    labels: bool = False,
    confidence: bool = False,
) -> pa.Schema:
    """Output columns: row, id, text, [samples], [reasoning], [label, [label_confidence]],
    finish_reason, tokens, error, [input]."""
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
    fields += [
        pa.field("finish_reason", pa.string()),
        pa.field("prompt_tokens", pa.int32()),
        pa.field("output_tokens", pa.int32()),
        pa.field("error", ERROR_TYPE),
    ]
    if input_type is not None:
        fields.append(pa.field("input", input_type))
    return pa.schema(fields)


def schema_to_text(schema: pa.Schema) -> str:
    """Serialize a schema for run.yaml (Arrow IPC, base64)."""
    return base64.b64encode(schema.serialize().to_pybytes()).decode()


def schema_from_text(text: str) -> pa.Schema:
    """Read a schema written by schema_to_text."""
    return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(text)))


def schema_summary(schema: pa.Schema) -> dict[str, str]:
    """Readable column -> type map, for people reading run.yaml."""
    return {f.name: str(f.type) for f in schema}


def error_row(row: int, id_: Any, kind: str, message: str, prompt_tokens: Optional[int] = None) -> dict[str, Any]:
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


def rows_to_table(rows: list[dict[str, Any]], schema: pa.Schema) -> pa.Table:
    """Rows as a table of exactly the run's schema (absent optional columns are null)."""
    return pa.Table.from_pylist(rows, schema=schema)


def table_to_jsonl(table: pa.Table) -> bytes:
    """JSON lines of a table, one object per row, in schema column order."""
    lines = [json.dumps(r, ensure_ascii=False, default=str) for r in table.to_pylist()]
    return ("\n".join(lines) + "\n").encode() if lines else b""


def jsonl_to_table(data: bytes, schema: pa.Schema) -> pa.Table:
    """Parse JSON lines written by table_to_jsonl back into the run's schema."""
    rows = [json.loads(line) for line in data.splitlines() if line.strip()]
    return pa.Table.from_pylist(rows, schema=schema)
