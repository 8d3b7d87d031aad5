"""JSON lines streamed by pyarrow into an Arrow file in `Dataset.save_to_disk`'s layout, with the types
`datasets` would give them (its first chunk's, or one schema over all rows where later rows differ)."""

from __future__ import annotations

import io
import json
import os
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Optional, Union

import pyarrow as pa
import pyarrow.compute as pc

from batchinfer.inputs.compressed import COMPRESSION_SUFFIXES
from batchinfer.inputs.datasets_reader import first_chunk_and_rest
from batchinfer.inputs.idcheck import IdHashes
from batchinfer.inputs.line_counts import count_lines, longest_line
from batchinfer.inputs.object_lines import Guarded, NotObjectLine, objects_only
from batchinfer.inputs.textfiles import (
    ARROW_SAFE_DEPTH,
    TypeConflict,
    TypesDiffer,
    dates_as_text,
    find_conflict,
    line_chunks,
    nests_deeper,
    unify_schemas,
)
from batchinfer.security import remove_path

# Where a later row or file does not fit those types, every file is read in chunks of about this
# size for one schema over all rows (each chunk parsed as one block: pyarrow's reader can crash on a
# type change between the blocks of one read).
SCHEMA_CHUNK_BYTES = 8 << 20
# pyarrow's streaming reader keeps ~40 blocks in flight: 1 MB blocks hold its memory to ~40 MB.
JSONL_BLOCK_BYTES = 1 << 20
WRITE_BATCH_BYTES = 32 << 20  # the record batches written: ~80,000 rows of ~415 bytes
ARROW_CODECS = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd"}
DATA_FILE = "data-00000-of-00001.arrow"


def jsonl_to_arrow(
    files: list[Path], dest: Path, id_column: Optional[str]
) -> Union[tuple[int, pa.Schema, Optional[IdHashes]], TypeConflict, None]:
    """JSON lines streamed by pyarrow into one Arrow file in `Dataset.save_to_disk`'s layout at dest;
    the row count, schema and the id column's hashes, taken as it was written (None without an id
    column). The types are the first chunk's or,
    where a later row or file does not fit them, one schema over all rows (`_one_schema`). Else the
    line-by-line check and `datasets` decide: None where a line pyarrow cannot read, one that is not
    exactly one object, or a file `datasets` would read into other types; the first value no type
    promotion joins with its column's (which `datasets` may still read, e.g. as JSON text)."""
    import pyarrow.json as paj

    head, head_size, more = first_chunk_and_rest(files[0])
    if not objects_only(head) or nests_deeper(head, ARROW_SAFE_DEPTH):
        return None  # the line-by-line check names the line (pyarrow would crash on `null`, or go too deep)
    try:
        table = paj.read_json(io.BytesIO(head), read_options=paj.ReadOptions(block_size=max(len(head), 1)))
        schema = dates_as_text(table.schema)  # text stays text
    except (pa.ArrowException, UnicodeDecodeError):
        return None
    features = _features_as_datasets_reads(schema)
    if features is None or (any(_keys_may_vary(b) for b in table.to_batches()) and _objects_vary(head)):
        return None
    # The first chunk's rows as read for its types are its rows under them (where no date became text):
    # the stream goes on after it instead of parsing it again.
    reuse = table.num_rows and table.schema.equals(features.arrow_schema)
    first = _Head(table, head, head_size, more) if reuse else None
    del table
    # A row must fit in a block: blocks well above the first chunk's longest line, 16x if a later one does not.
    longest = longest_line(head)
    block = max(JSONL_BLOCK_BYTES, 1 << (4 * longest).bit_length())
    rows = _stream_in_blocks(files, dest, id_column, features, block, first)
    if isinstance(rows, _Misfit):
        one = _one_schema(files, features.arrow_schema, rows)
        if not isinstance(one, pa.Schema):
            return one
        one = dates_as_text(one)
        if one.equals(features.arrow_schema):
            return None  # the types fit: pyarrow refused something else, which the line-by-line check names
        features = _features_as_datasets_reads(one)
        if features is None:
            return None
        rows = _stream_in_blocks(files, dest, id_column, features, block)
    if not isinstance(rows, tuple):
        return None
    _write_dataset_state(dest, features)
    return rows[0], features.arrow_schema, rows[1]


class _Misfit(Exception):
    """pyarrow refused a block of files[file] under the types given, after `rows` rows of it (which,
    and the files before it, fit those types)."""

    def __init__(self, file: int, rows: int) -> None:
        super().__init__(file, rows)
        self.file, self.rows = file, rows


def _stream_in_blocks(
    files: list[Path], dest: Path, id_column: Optional[str], features: Any, block: int, head: Optional[_Head] = None
) -> Any:
    """`_stream_jsonl` into a new dest with blocks of `block` bytes, or 16x where a row is longer: the
    row count and id hashes, None (left to the line-by-line check), or where a value does not fit the types, _Misfit."""
    for size in (block, 16 * block):
        remove_path(dest, ignore_errors=True)
        try:
            return _stream_jsonl(files, dest, id_column, features, size, head)
        except _Misfit as e:
            return e
        except pa.ArrowInvalid as e:
            if "straddl" not in str(e):
                return None
        except (pa.ArrowException, UnicodeDecodeError, OSError, NotObjectLine):
            return None  # unreadable here: the line-by-line path says why, in the reader's words
    return None


def _one_schema(files: list[Path], schema: pa.Schema, fitted: _Misfit) -> Union[pa.Schema, TypeConflict, None]:
    """One schema over every row of every file: schema (the types the rows before the misfit were read
    with) joined by `unify_types` with each later chunk's types (ints and decimals make decimals, a
    key some rows lack is null in them); the first value that joins nothing, by file:line; None where
    pyarrow cannot read a chunk for another reason (the line-by-line check names it). One chunk in
    memory at a time."""
    import pyarrow.json as paj

    for k, path in enumerate(files[fitted.file :]):
        fit = fitted.rows if k == 0 else 0
        for line, chunk in line_chunks(path, SCHEMA_CHUNK_BYTES):
            # A chunk whose last line is at most the rows read already was read with schema: skipped
            # (blank lines make this skip less, never more).
            if line - 1 + chunk.count(b"\n") + (not chunk.endswith(b"\n")) <= fit:
                continue
            if not objects_only(chunk) or nests_deeper(chunk, ARROW_SAFE_DEPTH):
                return None
            try:
                options = paj.ReadOptions(block_size=len(chunk) + 1)
                schema = unify_schemas(schema, paj.read_json(io.BytesIO(chunk), read_options=options).schema)
            except TypesDiffer:
                return find_conflict(path, line, chunk, schema)
            except pa.ArrowInvalid as e:
                # pyarrow's own words for a type change within the chunk; anything else is a bad line
                return find_conflict(path, line, chunk, schema) if "changed from" in str(e) else None
            except (pa.ArrowException, UnicodeDecodeError):
                return None
    return schema


def _stream_jsonl(
    files: list[Path], dest: Path, id_column: Optional[str], features: Any, block: int, head: Optional[_Head] = None
) -> Optional[tuple[int, Optional[IdHashes]]]:
    """Every file streamed with the types of features into dest's data file, the ids hashed as they are
    written; the row count and the hashes, or None where a file's rows are not its lines with content.
    A block pyarrow refuses under those types (a field not in them, a value of another type) raises
    _Misfit. head: the first file's first chunk already read under those types (its rows come first,
    and that file is read from where the chunk ends)."""
    import pyarrow.json as paj

    schema = features.arrow_schema
    read_options = paj.ReadOptions(block_size=block)
    parse_options = paj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="error")
    id_at = schema.get_field_index(id_column) if id_column else -1
    rows = 0
    dest.mkdir(parents=True)
    with ExitStack() as stack:
        data = stack.enter_context(
            pa.ipc.new_stream(stack.enter_context(pa.OSFile(str(dest / DATA_FILE), "wb")), schema)
        )
        ids = IdHashes() if id_at >= 0 else None
        pending: list[pa.RecordBatch] = []
        pending_bytes = 0
        for at, path in enumerate(files):
            skip = head.size if head is not None and at == 0 else 0
            source = _arrow_source(path, skip)
            if source is None:
                return None
            stack.enter_context(source)
            file_rows = lines = 0
            more = True  # bytes to read: all of a file, or the first one's after its first chunk
            if skip and head is not None:
                for batch in head.table.to_batches():
                    batch = pa.record_batch(batch.columns, schema=schema)
                    batch.validate(full=True)
                    pending.append(batch)
                    pending_bytes += batch.nbytes
                file_rows, lines, more = head.table.num_rows, head.lines, head.more
            try:
                batches = paj.open_json(source, read_options=read_options, parse_options=parse_options) if more else []
                for batch in batches:
                    # pyarrow passes invalid UTF-8 through into strings: the line-by-line check names it.
                    batch.validate(full=True)
                    pending.append(batch)
                    pending_bytes += batch.nbytes
                    if pending_bytes >= WRITE_BATCH_BYTES:
                        _write_batches(pending, data, ids, id_at)
                        pending_bytes = 0
                    file_rows += batch.num_rows
            except pa.ArrowInvalid as e:
                if "straddl" in str(e):
                    raise
                raise _Misfit(at, file_rows) from e
            # pyarrow also reads two objects on a line, or one over several lines: each line must be one
            # row. The lines were counted as pyarrow read them; blank ones, where there are, by a pass more.
            if file_rows != lines + source.starts.lines and file_rows != count_lines(path, exact=True):
                return None
            rows += file_rows
        _write_batches(pending, data, ids, id_at)
    return rows, ids


def _write_batches(pending: list[pa.RecordBatch], data: Any, ids: Optional[IdHashes], id_at: int) -> None:
    """The pending batches as one, written to the data file, its id column hashed into ids; pending
    is emptied. Every reader of the input maps a run of pages around each batch's header (~64 KB): a
    batch per 1 MB block would cost every task ~25 MB per million rows."""
    if not pending:
        return
    if hasattr(pa, "concat_batches"):  # pyarrow >= 19: one copy, ~2x faster than through a Table
        joined = [pa.concat_batches(pending)]
    else:
        joined = pa.Table.from_batches(pending).combine_chunks().to_batches()
    for batch in joined:
        data.write_batch(batch)
        if ids is not None:
            ids.add(batch.column(id_at))
    pending.clear()


def _arrow_source(path: Path, skip: int = 0) -> Any:
    """What pyarrow reads path from, decompressing it natively, each line checked to start with `{`
    before pyarrow sees it (`object_lines`); None for a compression it lacks. skip: where to start, in
    the (decompressed) bytes: a line's start after the first."""
    name = path.name.lower()
    for suffix, codec in ARROW_CODECS.items():
        if name.endswith(suffix):
            if not pa.Codec.is_available(codec):
                return None
            stream = pa.input_stream(str(path), compression=codec)
            left = skip
            while left > 0:  # decompressed, not seekable: read up to there
                got = len(stream.read(min(left, 1 << 20)))
                if not got:
                    break
                left -= got
            return Guarded(stream, at_start=not skip)
    if name.endswith(COMPRESSION_SUFFIXES):
        return None
    raw = open(path, "rb", buffering=0)
    raw.seek(skip)
    return Guarded(raw, at_start=not skip)


class _Head:
    """The first file's first chunk as read for its types: its table, its line count, its size in the
    (decompressed) file (a BOM included) and whether the file goes on after it."""

    def __init__(self, table: pa.Table, chunk: bytes, size: int, more: bool) -> None:
        self.table = table
        self.lines = chunk.count(b"\n") + (bool(chunk) and not chunk.endswith(b"\n"))
        self.size = size
        self.more = more


def _features_as_datasets_reads(schema: pa.Schema) -> Any:
    """`datasets` Features for pyarrow's schema of a JSON lines file, or None where `datasets`' own
    JSON builder would give other types (an empty object as JSON text, agent traces)."""
    import datasets

    try:
        features = datasets.Features.from_arrow_schema(schema)
        features.arrow_schema  # noqa: B018  (where a type nests deeper than Arrow's schemas hold, this raises)
    except (pa.ArrowInvalid, RecursionError):
        return None  # the line-by-line check names the line nested too deep
    if not features.arrow_schema.equals(schema) or any(_empty_objects(f.type) for f in schema):
        return None
    try:
        from datasets.packaged_modules.json.json import has_agent_traces_markers

        if has_agent_traces_markers(features):
            return None
    except ImportError:  # older `datasets`: no such reading
        pass
    return features


def _empty_objects(t: pa.DataType) -> bool:
    """Whether a type is or holds a struct without fields (`{}` in every row)."""
    if pa.types.is_struct(t) and t.num_fields == 0:
        return True
    return any(_empty_objects(t.field(i).type) for i in range(t.num_fields))


def _keys_may_vary(batch: pa.RecordBatch) -> bool:
    """Whether an object below the row may lack a key another one has: a field null where its object
    is not (a missing key and a null value look alike in Arrow)."""

    def varies(arr: pa.Array) -> bool:
        if pa.types.is_struct(arr.type):
            valid = arr.is_valid()
            for i in range(arr.type.num_fields):
                child = arr.field(i)
                if child.null_count and pc.any(pc.and_(valid, child.is_null())).as_py():
                    return True
                if varies(child):
                    return True
            return False
        if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
            return varies(arr.flatten())
        return False

    return any(varies(col) for col in batch.columns)


def _objects_vary(head: bytes) -> bool:
    """Whether `datasets`' JSON builder finds objects with varying keys in the first chunk, which it
    keeps as JSON text (a check its newer versions make; none in older ones)."""
    try:
        from datasets.utils.json import find_mixed_struct_types_field_paths, ujson_loads
    except ImportError:
        return False
    try:  # as the builder does: a line that is not JSON skips the check
        examples = [ujson_loads(line) for line in head.splitlines()]
    except ValueError:
        return False
    return bool(find_mixed_struct_types_field_paths(examples))


def _write_dataset_state(dest: Path, features: Any) -> None:
    """state.json and dataset_info.json beside dest's one data file, as `Dataset.save_to_disk` writes them."""
    import datasets

    state = {
        "_data_files": [{"filename": DATA_FILE}],
        "_fingerprint": os.urandom(8).hex(),
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": "train",
    }
    (dest / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True), encoding="utf-8")
    datasets.DatasetInfo(features=features, builder_name="json", dataset_name="json").write_to_directory(str(dest))
