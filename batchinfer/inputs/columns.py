"""input.columns names: a column or nested field (`meta.text`) found in a schema and in a row."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from batchinfer.errors import InputError


def column_type(schema: pa.Schema, dotted: str, source: str) -> pa.DataType:
    """Arrow type of a column or a nested field (`meta.text`); a missing one is an error naming it."""
    top, *rest = dotted.split(".")
    if top not in schema.names:
        raise InputError(
            f"{source}: input.columns names {dotted!r} but the input has no column {top!r} (columns: {', '.join(schema.names)})"
        )
    typ = schema.field(top).type
    for part in rest:
        if not pa.types.is_struct(typ) or typ.get_field_index(part) < 0:
            raise InputError(f"{source}: input.columns names {dotted!r} but {top!r} has no field {part!r}")
        typ = typ.field(part).type
    return typ


def get_path(row: dict[str, Any], dotted: str) -> Any:
    """A row's value at a column or nested field (`meta.text`); None where a level is missing."""
    value: Any = row
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value
