"""An image column's cells as the worker's rows hold them (JSON text decoded), for prepare's record,
redo's selection and report (rundir/image_files.py, rundir/splice.py, insight/image_counts.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Optional

from batchinfer.inputs.openai_batch import IMAGE_URL


def image_column_of(prompt_image_column: Optional[str], columns: list[str]) -> Optional[str]:
    """The input column holding rows' images: prompt.image_column, else an OpenAI input's image_url column."""
    if prompt_image_column:
        return prompt_image_column
    return IMAGE_URL if IMAGE_URL in columns else None


def is_json_text(ds: Any, column: str) -> bool:
    """Whether `datasets` keeps the column as JSON text (its Json feature: a JSON lines column whose
    values are of mixed types, "0.png" beside 7); the worker's rows hold the decoded values."""
    from datasets import Json

    features = getattr(ds, "features", None)  # a referenced corpus has no JSON text columns
    return features is not None and isinstance(features.get(column), Json)


def image_cells(values: list[Any], json_text: bool) -> list[Any]:
    """An image column's stored values as the worker's rows hold them: JSON text decoded (`datasets`'
    own decode, as its rows are read), other values as they are."""
    if not json_text:
        return values
    from datasets import Json

    decode = Json().decode_example
    return [decode(v) if v is not None else None for v in values]


def column_values(ds: Any, column: str) -> Iterator[Any]:
    """The column's values of a converted input (DIR/input) as the worker sees them (image_cells),
    one Arrow chunk in memory at a time."""
    json_text = is_json_text(ds, column)
    for chunk in ds.data.column(column).chunks:
        yield from image_cells(chunk.to_pylist(), json_text)
