"""Images of a run's committed rows, for `report`: rows with an image, rows whose image was an error
row (kind image), and distinct images by content digest (a file's digest from DIR/images.json, an
image held in the row digested here; the digest output.reuse and dedup key on). Read from the
committed rows' `row` and `error` columns and the input's image column."""

from __future__ import annotations

from typing import Any, Optional, TypedDict

import pyarrow as pa
import pyarrow.compute as pc

from batchinfer.requests.images import KIND, ImageLimits, image_digest, image_ref
from batchinfer.requests.prompts import RowError
from batchinfer.rundir import image_files, passes
from batchinfer.rundir.committed import committed_columns
from batchinfer.rundir.store import RunDir


class ImageCounts(TypedDict):
    """report.json's `images`: over the committed rows."""

    column: str  # the input column holding the images
    rows: int  # committed rows
    rows_with_image: int
    image_error_rows: int  # error rows of kind image (missing, unreadable, corrupt, too large)
    distinct_images: int  # by content digest, over the rows whose image was read
    files: Optional[int]  # image files the rows name (DIR/images.json; None: no record)
    undigested: int  # rows with an http URL, or a file DIR/images.json lacks: not in distinct_images


def _committed(run: RunDir) -> pa.Table:
    """`row` and `error` of every committed row (after a redo, as merged: the redone rows' own)."""
    columns = ["row", "error"]
    if not passes.pass_numbers(run):
        return committed_columns(run, columns)
    from batchinfer.rundir.splice import merged_view  # a redo's rows replace DIR's: its merged view holds them

    schema = pa.schema([run.schema.field(c) for c in columns])
    tables = [t.select(columns).cast(schema) for t in merged_view(run)]
    return pa.concat_tables(tables) if tables else schema.empty_table()


def image_counts(run: RunDir) -> Optional[ImageCounts]:
    """The images of the run's committed rows; None for a run without images."""
    from batchinfer.inputs.convert import open_input

    ds = open_input(run.input_dir)
    column = image_files.image_column_of(run.config.prompt.image_column, ds.column_names)
    if column is None or column not in ds.column_names:
        return None
    t = _committed(run)
    image_errors = pc.fill_null(pc.equal(pc.struct_field(t["error"], "kind"), KIND), False)
    stored = ds.data.column(column).take(pa.array(t["row"].to_pylist(), pa.int64())).to_pylist()
    values = image_files.image_cells(stored, image_files.is_json_text(ds, column))
    files = image_files.read_record(run.path)
    by_path = {f.path: f.digest for f in files or []}
    limits = ImageLimits.of(run.config.prompt, run.config.input.path)
    digests, undigested = set(), 0
    for value, failed in zip(values, image_errors.to_pylist(), strict=True):
        if value is None or failed:
            continue
        digest = _digest(value, column, limits, by_path)
        if digest is None:
            undigested += 1
        else:
            digests.add(digest)
    return ImageCounts(
        column=column,
        rows=len(t),
        rows_with_image=sum(v is not None for v in values),
        image_error_rows=int(pc.sum(pc.cast(image_errors, pa.int64())).as_py() or 0),
        distinct_images=len(digests),
        files=len(files) if files is not None else None,
        undigested=undigested,
    )


def _digest(value: Any, column: str, limits: ImageLimits, by_path: dict[str, Optional[str]]) -> Optional[str]:
    try:
        ref = image_ref(value, column, limits)
    except RowError:
        return None
    if ref.data is not None:
        return image_digest(ref.data)
    return by_path.get(str(ref.path)) if ref.path is not None else None


def image_lines(c: ImageCounts) -> list[str]:
    """report.md's images section."""
    files = f" ({c['files']:,} image files named)" if c["files"] is not None else ""
    lines = [
        "## Images",
        "",
        f"{c['rows_with_image']:,} of {c['rows']:,} committed rows have an image (column `{c['column']}`); "
        f"{c['image_error_rows']:,} are error rows of kind image (missing, unreadable, corrupt or too large); "
        f"{c['distinct_images']:,} distinct images by content digest{files}.",
    ]
    if c["undigested"]:
        lines.append(f"{c['undigested']:,} rows' images (http URLs) are not counted among the distinct ones.")
    return lines
