"""Open inputs (files, globs, compressed, saved datasets), convert them once to Arrow, plan shards."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import pyarrow as pa
import pyarrow.compute as pc

from batchinfer.errors import InputError
from batchinfer.inputs.openai_batch import convert_requests, looks_like_openai_batch
from batchinfer.inputs.reference import (
    is_reference,
    manifest_ids,
    manifest_schema,
    open_reference,
    plan_reference,
    reference_fingerprint,
    write_manifest,
)
from batchinfer.inputs.textfiles import (
    COMPRESSION_SUFFIXES,
    TypeConflict,
    TypesDiffer,
    count_lines,
    csv_header,
    extend_feature,
    find_conflict,
    first_line,
    json_type,
    line_chunks,
    open_text,
    scan_jsonl,
    text_lines,
    unify_schemas,
    unify_types,
)
from batchinfer.models.locations import looks_local
from batchinfer.security import remove_path

FORMATS_BY_SUFFIX = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "json",
    ".csv": "csv",
    ".tsv": "tsv",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".feather": "arrow",
    ".ipc": "arrow",
}
FORMATS = ("jsonl", "json", "csv", "tsv", "parquet", "arrow", "hf_disk", "openai")
GLOB_CHARS = set("*?[")
HUB_PREFIX = "hf://datasets/"
# `datasets`' JSON builder takes its types from the first 10 MB of the first file and casts the rest to
# them; the fast path reads that chunk first and streams every file with its types. Passed to the
# builder (its own default, checked by a test) so that the two always agree.
DATASETS_CHUNK_BYTES = 10 << 20
# Where a later row or file does not fit those types, every file is read in chunks of about this
# size for one schema over all rows (each chunk parsed as one block: pyarrow's reader can crash on a
# type change between the blocks of one read).
SCHEMA_CHUNK_BYTES = 8 << 20
# pyarrow's streaming reader keeps ~40 blocks in flight: 1 MB blocks hold its memory to ~40 MB.
JSONL_BLOCK_BYTES = 1 << 20
WRITE_BATCH_BYTES = 32 << 20  # the record batches written: ~80,000 rows of ~415 bytes
ARROW_CODECS = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd"}
DATA_FILE = "data-00000-of-00001.arrow"
IdChunks = Callable[[], Iterable[pa.Array]]


@dataclass(frozen=True)
class Shard:
    """One contiguous range of input rows, [start, stop)."""

    index: int
    start: int
    stop: int

    @property
    def rows(self) -> int:
        """Number of rows in the shard."""
        return self.stop - self.start


def input_files(path: str, split: str = "train") -> list[Path]:
    """input.path resolved: a file, a glob of files (sorted), a `save_to_disk` folder, or a hub
    dataset's files for one split."""
    # Absolute, not resolved: a hub snapshot's files are symlinks to suffix-less blobs.
    if looks_like_hub_dataset(path):
        return hub_dataset_files(path, split)
    if GLOB_CHARS & set(path):
        base = Path(path).expanduser()
        if not base.is_absolute():
            base = Path.cwd() / base
        matches = Path(base.anchor).glob(str(base.relative_to(base.anchor)))
        files = sorted(Path(os.path.abspath(p)) for p in matches if p.is_file())
        if not files:
            raise InputError(f"input.path {path}: the pattern matches no file")
        return files
    p = Path(os.path.abspath(Path(path).expanduser()))
    if not p.exists():
        raise InputError(f"input.path {path}: no such file (resolved to {p})")
    if not os.access(p, os.R_OK):
        raise InputError(f"input.path {path}: not readable (permission denied; resolved to {p})")
    if p.is_dir() and not is_saved_dataset(p):
        raise InputError(f"input.path {path}: a folder, but not a `Dataset.save_to_disk` folder; give a file or a glob")
    return [p]


def looks_like_hub_dataset(path: str) -> bool:
    """hf://datasets/org/name[@rev], or org/name when no such local path exists."""
    if path.startswith(HUB_PREFIX):
        return True
    return not looks_local(path) and not GLOB_CHARS & set(path) and not Path(path).suffix


def hub_dataset_files(name: str, split: str) -> list[Path]:
    """A hub dataset's data files for one split: downloaded when the hub is reachable, else (and
    always with HF_HUB_OFFLINE=1) taken from the local Hugging Face cache."""
    from datasets.data_files import get_data_patterns, resolve_pattern
    from huggingface_hub import snapshot_download

    repo, _, revision = name.removeprefix(HUB_PREFIX).partition("@")
    try:
        snap = snapshot_download(repo, repo_type="dataset", revision=revision or None)
    except Exception as e:  # offline and not cached, unknown repo, gated, network down: one message
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(
            f"input.path {name}: no such local file, and the hub dataset {repo!r} could not be "
            f"fetched ({reason}). Offline (HF_HUB_OFFLINE=1) only the local cache is used: run "
            f"`huggingface-cli download --repo-type dataset {repo}` where the hub is reachable "
            f"(HF_TOKEN for gated data), or give a local file"
        ) from None
    patterns = get_data_patterns(snap)
    if split not in patterns:
        raise InputError(f"input.path {name}: no split {split!r} (splits: {', '.join(patterns)}); set input.split")
    found = {f for pattern in patterns[split] for f in resolve_pattern(pattern, base_path=snap)}
    return sorted(Path(f) for f in found)


def is_saved_dataset(path: Path) -> bool:
    """Whether a folder was written by `datasets.Dataset.save_to_disk`."""
    return (path / "state.json").is_file() and (path / "dataset_info.json").is_file()


def detect_format(files: list[Path], fmt: Optional[str]) -> str:
    """The input format: as configured, else from the (first) file's suffix, compression aside."""
    if fmt:
        return fmt
    first = files[0]
    if first.is_dir():
        return "hf_disk"
    name = first.name.lower()
    for comp in COMPRESSION_SUFFIXES:
        name = name.removesuffix(comp)
    suffix = Path(name).suffix
    if suffix not in FORMATS_BY_SUFFIX:
        known = ", ".join(sorted(FORMATS_BY_SUFFIX))
        raise InputError(
            f"{first}: cannot tell the format from the suffix {suffix!r} (known: {known}); set input.format"
        )
    fmt = FORMATS_BY_SUFFIX[suffix]
    if fmt == "jsonl" and looks_like_openai_batch(first_line(first)):
        return "openai"
    return fmt


def file_fingerprint(
    files: list[Path], previous: Optional[dict[str, Any]] = None, fmt: Optional[str] = None
) -> dict[str, Any]:
    """The input's identity: for a Parquet or Arrow corpus read in place its footers and sizes (the
    data is not read), else a content hash of every file; reused when names, sizes and mtimes match
    the previous record. A record from before footers (no `method`) stays a content hash."""
    members = sorted(f for p in files for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file())
    stats = [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in members]
    if previous and previous.get("files") == stats:
        return previous
    size = sum(s[1] for s in stats)
    manifest = plan_reference(files, fmt) if fmt and (previous is None or "method" in previous) else None
    if manifest is not None:
        return {
            "files": stats,
            "size": size,
            "fingerprint": reference_fingerprint(manifest, files),
            "method": "footers",
        }
    h = hashlib.blake2b(digest_size=16)
    for f in members:
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            while block := fh.read(1 << 20):
                h.update(block)
    return {"files": stats, "size": size, "fingerprint": h.hexdigest()}


def _load(files: list[Path], fmt: str, cache_dir: Path, shown: str) -> Any:
    import datasets

    datasets.disable_progress_bars()
    # Its "Failed to read file" log lines would precede our own message about the same failure.
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    names = [str(f) for f in files]
    cache = str(cache_dir)
    if fmt in ("jsonl", "openai") and sum(scan_jsonl(f) for f in files) == 0:
        raise InputError(f"{shown}: no rows (only blank lines); there is nothing to run")
    if fmt == "openai":
        cache_dir.mkdir(parents=True, exist_ok=True)
        convert_requests(files, cache_dir / "requests.parquet", open_text)
        return datasets.Dataset.from_parquet(str(cache_dir / "requests.parquet"), cache_dir=cache)
    if fmt in ("jsonl", "json"):
        return datasets.Dataset.from_json(names, cache_dir=cache, chunksize=DATASETS_CHUNK_BYTES)
    if fmt in ("csv", "tsv"):
        # Cells are the strings they are: pandas' guesses would make `007` the number 7 (and a
        # duplicate of `7`), `1e3` 1000.0, and the texts NA, null, N/A, nan nulls.
        sep = "\t" if fmt == "tsv" else ","
        strings = datasets.Features({name: datasets.Value("string") for name in csv_header(files[0], sep)})
        return datasets.Dataset.from_csv(
            names,
            cache_dir=cache,
            sep=sep,
            features=strings,
            keep_default_na=False,
            na_filter=False,
        )
    if fmt == "parquet":
        return datasets.Dataset.from_parquet(names, cache_dir=cache)
    if fmt == "arrow":
        return datasets.load_dataset("arrow", data_files=names, split="train", cache_dir=cache)
    if fmt == "hf_disk":
        return datasets.load_from_disk(names[0])
    raise InputError(f"input.format={fmt!r} is not supported ({', '.join(FORMATS)})")


def _read_error(files: list[Path], fmt: str, shown: str, e: Exception) -> InputError:
    """An unreadable input, said as file:line where the cause is bad UTF-8, else in the reader's words."""
    if fmt in ("csv", "tsv", "json"):
        for f in files:  # the readers name no line for bad UTF-8; this pass only runs on failure
            for _ in text_lines(f):
                pass
    while e.__cause__ is not None and "error occurred while generating" in str(e):
        e = e.__cause__  # datasets wraps the reader's own error in a message that says nothing
    reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
    if "corresponds to no data" in reason:  # datasets' words for a header-only CSV
        return InputError(f"{shown}: no rows (only a header); there is nothing to run")
    return InputError(f"{shown}: cannot be read as {fmt} ({reason}); check the file or set input.format")


def convert_input(
    files: list[Path],
    fmt: str,
    dest: Path,
    id_column: Optional[str],
    columns: Optional[list[str]],
    strict_ids: bool = True,
    local_cache: bool = False,
) -> int:
    """Make dest the input tasks read, once; return its row count. A Parquet or Arrow corpus is
    referenced in place (dest holds a manifest of its files), other formats are converted into an
    Arrow dataset. With strict_ids=False null or duplicate ids are left for the caller to report
    (`batchinfer validate`). local_cache puts `datasets`' cache (and its file locks) in a node-local
    temporary folder instead of beside dest."""
    shown = str(files[0]) if len(files) == 1 else f"{files[0].parent}/ ({len(files)} files)"
    if all(f.is_file() and f.stat().st_size == 0 for f in files):
        raise InputError(f"{shown}: no rows (the file is empty); there is nothing to run")
    tmp = dest.with_name(dest.name + ".tmp")
    remove_path(tmp, ignore_errors=True)
    manifest = plan_reference(files, fmt)
    if manifest is not None:
        try:
            _check_input(
                shown,
                manifest["rows"],
                manifest_schema(manifest),
                id_column,
                columns,
                lambda: manifest_ids(manifest, id_column or ""),
                strict_ids,
            )
            write_manifest(dict(manifest, source=shown), tmp)
            os.replace(tmp, dest)
        finally:
            remove_path(tmp, ignore_errors=True)
        return manifest["rows"]
    if local_cache:
        cache = Path(tempfile.mkdtemp(prefix="batchinfer-convert-"))
    else:
        cache = dest.with_name(".hf-cache")
        remove_path(cache, ignore_errors=True)  # a symlink here would send datasets' cache outside DIR
    try:
        ds = None
        fast = _jsonl_to_arrow(files, tmp, cache / "ids.arrow", id_column) if fmt == "jsonl" else None
        if isinstance(fast, tuple):
            rows, schema = fast
            # The ids' own file: passes over them read ~20 bytes a row, not the whole data file.
            ids: IdChunks = lambda: _stream_column(cache / "ids.arrow")  # noqa: E731
        else:
            remove_path(tmp, ignore_errors=True)
            try:
                ds = _load(files, fmt, cache, shown)
            except InputError:
                raise
            except Exception as e:  # the readers raise ValueError, OSError, ArrowException, DatasetGenerationError
                if isinstance(fast, TypeConflict):  # what `datasets` could not cast either, by line and column
                    raise InputError(fast.message()) from None
                ds = _load_extended(files, cache) if fmt == "jsonl" and fast is None else None
                if ds is None:
                    raise _read_error(files, fmt, shown, e) from None
            rows, schema = len(ds), ds.data.schema
            ids = lambda: ds.data.column(id_column).chunks  # noqa: E731
        _check_input(shown, rows, schema, id_column, columns, ids, strict_ids)
        if ds is not None:
            ds.save_to_disk(str(tmp))
        os.replace(tmp, dest)
        return rows
    finally:
        remove_path(cache, ignore_errors=True)
        remove_path(tmp, ignore_errors=True)


def _check_input(
    shown: str,
    rows: int,
    schema: pa.Schema,
    id_column: Optional[str],
    columns: Optional[list[str]],
    ids: IdChunks,
    strict_ids: bool,
) -> None:
    """Rows present, the id column there (and its ids unique with strict_ids), input.columns there."""
    if rows == 0:
        raise InputError(f"{shown}: no rows; there is nothing to run")
    if id_column is not None:
        if id_column not in schema.names:
            raise InputError(
                f"{shown}: input.id_column={id_column!r} is not a column (columns: {', '.join(schema.names)})"
            )
        if strict_ids:
            check_ids(shown, ids, id_column)
    for col in columns or []:
        column_type(schema, col, shown)


def _jsonl_to_arrow(
    files: list[Path], dest: Path, ids_file: Path, id_column: Optional[str]
) -> Union[tuple[int, pa.Schema], TypeConflict, None]:
    """JSON lines streamed by pyarrow into one Arrow file in `Dataset.save_to_disk`'s layout at dest,
    the id column also into ids_file; the row count and schema. The types are the first chunk's or,
    where a later row or file does not fit them, one schema over all rows (`_one_schema`). Else the
    line-by-line check and `datasets` decide: None where a line pyarrow cannot read, one that is not
    exactly one object, or a file `datasets` would read into other types; the first value no type
    promotion joins with its column's (which `datasets` may still read, e.g. as JSON text)."""
    import pyarrow.json as paj

    head = _first_chunk(files[0])
    try:
        table = paj.read_json(io.BytesIO(head), read_options=paj.ReadOptions(block_size=max(len(head), 1)))
        schema = table.schema
    except (pa.ArrowException, UnicodeDecodeError):
        return None
    features = _features_as_datasets_reads(schema)
    if features is None or (any(_keys_may_vary(b) for b in table.to_batches()) and _objects_vary(head)):
        return None
    del table
    # A row must fit in a block: blocks well above the first chunk's longest line, 16x if a later one does not.
    longest = max((len(line) for line in head.splitlines()), default=0)
    block = max(JSONL_BLOCK_BYTES, 1 << (4 * longest).bit_length())
    rows = _stream_in_blocks(files, dest, ids_file, id_column, features, block)
    if isinstance(rows, _Misfit):
        one = _one_schema(files, features.arrow_schema, rows)
        if not isinstance(one, pa.Schema):
            return one
        if one.equals(features.arrow_schema):
            return None  # the types fit: pyarrow refused something else, which the line-by-line check names
        features = _features_as_datasets_reads(one)
        if features is None:
            return None
        rows = _stream_in_blocks(files, dest, ids_file, id_column, features, block)
    if not isinstance(rows, int):
        return None
    _write_dataset_state(dest, features)
    return rows, features.arrow_schema


class _Misfit(Exception):
    """pyarrow refused a block of files[file] under the types given, after `rows` rows of it (which,
    and the files before it, fit those types)."""

    def __init__(self, file: int, rows: int):
        super().__init__(file, rows)
        self.file, self.rows = file, rows


def _stream_in_blocks(
    files: list[Path], dest: Path, ids_file: Path, id_column: Optional[str], features: Any, block: int
) -> Any:
    """`_stream_jsonl` into a new dest with blocks of `block` bytes, or 16x where a row is longer: the
    row count, None (left to the line-by-line check), or where a value does not fit the types, _Misfit."""
    for size in (block, 16 * block):
        remove_path(dest, ignore_errors=True)
        try:
            return _stream_jsonl(files, dest, ids_file, id_column, features, size)
        except _Misfit as e:
            return e
        except pa.ArrowInvalid as e:
            if "straddl" not in str(e):
                return None
        except (pa.ArrowException, UnicodeDecodeError, OSError):
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


def _load_extended(files: list[Path], cache: Path) -> Any:
    """JSON lines that `datasets` refused under its first chunk's types, read by `datasets` with those
    types extended over every row (`_extended_features`); None where that does not help (the first
    error stands). A value it cannot cast is named by file:line and column."""
    import datasets

    features = _extended_features(files, cache / "first-chunk")
    if isinstance(features, TypeConflict):
        raise InputError(features.message())
    if features is None:
        return None
    try:
        return datasets.Dataset.from_json(
            [str(f) for f in files], cache_dir=str(cache), features=features, chunksize=DATASETS_CHUNK_BYTES
        )
    except Exception:  # as in _load: the readers raise many kinds
        return None


def _extended_features(files: list[Path], scratch: Path) -> Union[Any, TypeConflict, None]:
    """The `datasets` Features its JSON builder takes from the first chunk (JSON text columns
    included), extended by `extend_feature` with every later chunk of every file as the builder reads
    it; the first value the builder could not cast to them, by file:line; None where nothing changed,
    a chunk cannot be read, or this `datasets` has no such reading."""
    import datasets

    try:
        from datasets.packaged_modules.json.json import AGENT_TRACES_FEATURES
        from datasets.utils.json import get_json_field_paths_from_feature
    except ImportError:
        return None
    scratch.mkdir(parents=True, exist_ok=True)
    head = scratch / "first-chunk.jsonl"
    head.write_bytes(_first_chunk(files[0]))
    try:  # the builder itself on the same bytes: its types, JSON text columns and all
        first = datasets.Dataset.from_json(str(head), cache_dir=str(scratch), chunksize=DATASETS_CHUNK_BYTES).features
    except Exception:
        return None
    if first == AGENT_TRACES_FEATURES:
        return None
    paths = get_json_field_paths_from_feature(first)
    features = first
    for k, path in enumerate(files):
        for line, chunk in line_chunks(path, DATASETS_CHUNK_BYTES):
            if k == 0 and line == 1:
                continue  # the chunk the types come from
            read = _read_as_datasets(chunk, paths)
            if read is None:
                return None
            table, mixed = read
            features = extend_feature(features, pa.struct(table.schema))
            refused = _refused_column(table, features)
            if refused is None:
                continue
            if any(p and p[0] == refused for p in mixed):  # its values are all JSON text here: kinds tell
                one = pa.schema([(refused, _json_as_null(features.arrow_schema.field(refused).type))])
                return find_conflict(path, line, _projected(chunk, refused), one)
            return _refused_line(path, line, chunk, table[refused], refused, features)
    return None if features == first else features


def _read_as_datasets(chunk: bytes, paths: list[list[Any]]) -> Optional[tuple[pa.Table, list[list[Any]]]]:
    """A later chunk read as `datasets`' JSON builder reads it: the fields at paths (its JSON text
    columns) encoded as JSON text, and a field whose type changes within the chunk too, its path
    added to paths for this chunk and the rest (as the builder does); the table and the paths added
    here; None where pyarrow cannot read it for another reason."""
    import pyarrow.json as paj
    from datasets.utils.json import (
        get_json_field_path_from_pyarrow_json_error,
        insert_json_field_path,
        json_encode_fields_in_json_lines,
        ujson_loads,
    )

    before = [list(p) for p in paths]
    while True:
        try:
            batch = json_encode_fields_in_json_lines(chunk, paths) if paths else chunk
            table = paj.read_json(io.BytesIO(batch), read_options=paj.ReadOptions(block_size=len(batch) + 1))
            return table, [p for p in paths if p not in before]
        except pa.ArrowInvalid as e:
            if "changed from" not in str(e):
                return None
            try:
                examples = (ujson_loads(line) for line in chunk.splitlines())
                field = get_json_field_path_from_pyarrow_json_error(str(e), examples=examples)
            except ValueError:
                return None
            if not field or any(field[: len(p)] == p for p in paths):
                return None
            insert_json_field_path(paths, field)
        except (pa.ArrowException, ValueError):
            return None


def _projected(chunk: bytes, name: str) -> bytes:
    """chunk's lines as objects of the one column `name` (lines kept in place, blank ones blank)."""
    return b"\n".join(
        json.dumps({name: json.loads(raw).get(name)}).encode() if raw.strip() else b"" for raw in chunk.split(b"\n")
    )


def _refused_column(table: pa.Table, features: Any) -> Optional[str]:
    """The first column of a chunk's table that `datasets` cannot cast to its feature, or None."""
    from datasets import Value
    from datasets.table import cast_array_to_feature

    schema = features.arrow_schema
    for name in table.column_names:
        column, feature = table[name], features[name]
        if column.type.equals(schema.field(name).type):
            continue
        if pa.types.is_struct(column.type) and feature == Value("string"):
            continue  # the builder writes these objects as JSON text
        try:
            cast_array_to_feature(column, feature)
        except (pa.ArrowException, TypeError, ValueError):
            return name
    return None


def _refused_line(
    path: Path, first_line: int, chunk: bytes, column: pa.ChunkedArray, name: str, features: Any
) -> Optional[TypeConflict]:
    """The line of chunk (lines of path from first_line on) whose value of column `name` `datasets`
    cannot cast to its feature: the shortest prefix of its values (nulls cast to anything) that does
    not cast ends there."""
    from datasets.table import cast_array_to_feature

    whole, feature = column.combine_chunks(), features[name]
    array, at = whole.drop_null(), pc.indices_nonzero(whole.is_valid()).to_pylist()
    if not len(array):
        return None

    def casts(n: int) -> bool:
        try:
            cast_array_to_feature(array.slice(0, n), feature)
            return True
        except (pa.ArrowException, TypeError, ValueError):
            return False

    good, bad = 0, len(array)
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if casts(mid) else (good, mid)
    rows = (i for i, raw in enumerate(chunk.split(b"\n")) if raw.strip(b" \t\r"))
    offset = next(i for n, i in enumerate(rows) if n == at[bad - 1])
    value = json.loads(chunk.split(b"\n")[offset]).get(name)
    before = _json_as_null(features.arrow_schema.field(name).type)
    try:  # the field inside the column where the kinds differ
        unify_types(before, json_type(value, (name,)), (name,))
    except TypesDiffer as e:
        return TypeConflict(path, first_line + offset, e.path, e.before, e.found)
    return TypeConflict(path, first_line + offset, (name,), before, json_type(value))


def _json_as_null(t: pa.DataType) -> pa.DataType:
    """A type with its JSON text parts (which hold any value) as null, which joins anything."""
    if isinstance(t, pa.BaseExtensionType):
        return pa.null()
    if pa.types.is_struct(t):
        return pa.struct([(f.name, _json_as_null(f.type)) for f in t])
    if pa.types.is_list(t):
        return pa.list_(_json_as_null(t.value_type))
    return t


def _first_chunk(path: Path) -> bytes:
    """The bytes `datasets`' JSON builder takes its types from: the first 10 MB and the rest of that
    line, a UTF-8 BOM dropped."""
    with open_text(path) as f:
        head = f.read(DATASETS_CHUNK_BYTES)
        head += f.readline()
    return head.removeprefix(b"\xef\xbb\xbf")


def _stream_jsonl(
    files: list[Path], dest: Path, ids_file: Path, id_column: Optional[str], features: Any, block: int
) -> Optional[int]:
    """Every file streamed with the types of features into dest's data file and the ids into ids_file;
    the row count, or None where a file's rows are not its lines with content. A block pyarrow refuses
    under those types (a field not in them, a value of another type) raises _Misfit."""
    import pyarrow.json as paj

    schema = features.arrow_schema
    read_options = paj.ReadOptions(block_size=block)
    parse_options = paj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="error")
    id_at = schema.get_field_index(id_column) if id_column else -1
    rows = 0
    dest.mkdir(parents=True)
    with ExitStack() as stack:
        # Lines are counted in a thread beside the parse (numpy counts without holding the GIL).
        counter = ThreadPoolExecutor(1)
        stack.callback(counter.shutdown, cancel_futures=True)
        lines = [counter.submit(count_lines, path) for path in files]
        data = stack.enter_context(
            pa.ipc.new_stream(stack.enter_context(pa.OSFile(str(dest / DATA_FILE), "wb")), schema)
        )
        if id_at >= 0:
            ids_file.parent.mkdir(parents=True, exist_ok=True)
            id_schema = pa.schema([schema.field(id_at).remove_metadata()])
            ids = stack.enter_context(pa.ipc.new_stream(stack.enter_context(pa.OSFile(str(ids_file), "wb")), id_schema))
        else:
            ids = id_schema = None
        pending: list[pa.RecordBatch] = []
        pending_bytes = 0
        for at, (path, counted) in enumerate(zip(files, lines, strict=True)):
            source = _arrow_source(path)
            if source is None:
                return None
            file_rows = 0
            try:
                for batch in paj.open_json(source, read_options=read_options, parse_options=parse_options):
                    # pyarrow passes invalid UTF-8 through into strings: the line-by-line check names it.
                    batch.validate(full=True)
                    pending.append(batch)
                    pending_bytes += batch.nbytes
                    if pending_bytes >= WRITE_BATCH_BYTES:
                        _write_batches(pending, data, ids, id_at, id_schema)
                        pending_bytes = 0
                    file_rows += batch.num_rows
            except pa.ArrowInvalid as e:
                if "straddl" in str(e):
                    raise
                raise _Misfit(at, file_rows) from e
            # pyarrow also reads two objects on a line, or one over several lines: each line must be one row.
            if file_rows != counted.result() and file_rows != count_lines(path, exact=True):
                return None
            rows += file_rows
        _write_batches(pending, data, ids, id_at, id_schema)
    return rows


def _write_batches(pending: list[pa.RecordBatch], data: Any, ids: Any, id_at: int, id_schema: Any) -> None:
    """The pending batches as one, written to the data file and its id column to the ids file; pending
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
            ids.write_batch(pa.record_batch([batch.column(id_at)], schema=id_schema))
    pending.clear()


def _arrow_source(path: Path) -> Any:
    """What pyarrow reads path from, decompressing it natively; None for a compression it lacks."""
    name = path.name.lower()
    for suffix, codec in ARROW_CODECS.items():
        if name.endswith(suffix):
            return pa.input_stream(str(path), compression=codec) if pa.Codec.is_available(codec) else None
    if name.endswith(COMPRESSION_SUFFIXES):
        return None
    return str(path)


def _features_as_datasets_reads(schema: pa.Schema) -> Any:
    """`datasets` Features for pyarrow's schema of a JSON lines file, or None where `datasets`' own
    JSON builder would give other types (an empty object as JSON text, agent traces)."""
    import datasets

    features = datasets.Features.from_arrow_schema(schema)
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


def _stream_column(path: Path) -> Iterable[pa.Array]:
    """The one column of an Arrow stream file, batch by batch, read rather than memory-mapped so
    that a pass over it leaves no resident pages behind."""
    with pa.OSFile(str(path)) as f:
        for batch in pa.ipc.open_stream(f):
            yield batch.column(0)


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


def id_problems(ids: Union[pa.ChunkedArray, IdChunks], column: str, limit: int = 5) -> tuple[int, list[str]]:
    """Null and duplicate ids: how many rows have one, and the first `limit` in row order said as
    messages. ids is a column or a function giving its chunks anew for each pass over them."""
    import numpy as np

    chunks: IdChunks = (lambda: ids.chunks) if isinstance(ids, pa.ChunkedArray) else ids  # type: ignore[union-attr]
    found: list[tuple[int, str]] = []  # (row, message), at most `limit` of each kind
    nulls, total = _null_rows(chunks, limit, found, column)
    # One 64-bit hash per id is all that is kept of the ids: 8 bytes a row, sorted in place.
    hashes = np.empty(total - nulls, np.uint64)
    at = 0
    for chunk in _grouped(chunks()):
        h = _id_hashes(chunk)
        if h is None:
            return nulls + _id_problems_python(chunks, limit, found), [msg for _, msg in sorted(found)[:limit]]
        h = h[chunk.is_valid().to_numpy(zero_copy_only=False)] if chunk.null_count else h
        hashes[at : at + len(h)] = h
        at += len(h)
    hashes.sort()
    repeated = np.unique(hashes[1:][hashes[1:] == hashes[:-1]])
    del hashes
    dups = _duplicates(*_with_hashes_in(chunks, repeated), limit, found) if len(repeated) else 0
    return nulls + dups, [msg for _, msg in sorted(found)[:limit]]


def _null_rows(chunks: IdChunks, limit: int, found: list[tuple[int, str]], column: str) -> tuple[int, int]:
    """Count null ids and add the first `limit`; the null count and the row count."""
    nulls = total = 0
    for chunk in _grouped(chunks()):
        if chunk.null_count:
            if nulls < limit:
                for row in pc.indices_nonzero(chunk.is_null()).to_numpy()[: limit - nulls]:
                    msg = f"row {total + row}: input.id_column {column!r} is null or missing; every row needs an id"
                    found.append((total + int(row), msg))
            nulls += chunk.null_count
        total += len(chunk)
    return nulls, total


def _grouped(chunks: Iterable[pa.Array], rows: int = 1 << 18) -> Iterable[pa.Array]:
    """Consecutive chunks as arrays of at least `rows` ids, dictionaries decoded: on chunks of a
    thousand ids Arrow's cost per call, not the ids, would take the time."""
    pending: list[pa.Array] = []
    count = 0
    for chunk in chunks:
        pending.append(_plain(chunk))
        count += len(chunk)
        if count >= rows:
            yield pending[0] if len(pending) == 1 else pa.concat_arrays(pending)
            pending, count = [], 0
    if pending:
        yield pending[0] if len(pending) == 1 else pa.concat_arrays(pending)


def _plain(chunk: pa.Array) -> pa.Array:
    """A dictionary-encoded chunk as its values; others as they are."""
    return chunk.dictionary_decode() if pa.types.is_dictionary(chunk.type) else chunk


def _with_hashes_in(chunks: IdChunks, repeated: Any) -> tuple[pa.Array, Any]:
    """The non-null ids whose hash is one of `repeated`, and their rows (ascending): every duplicate
    and its first row, and the rare id that only shares its hash."""
    import numpy as np

    values, rows = [], []
    offset = 0
    for chunk in _grouped(chunks()):
        hit = np.isin(_id_hashes(chunk), repeated)
        if chunk.null_count:
            hit &= chunk.is_valid().to_numpy(zero_copy_only=False)
        at = np.flatnonzero(hit)
        values.append(chunk.take(pa.array(at)))
        rows.append(at + offset)
        offset += len(chunk)
    return pa.concat_arrays(values), np.concatenate(rows)


_MIX = 0xBF58476D1CE4E5B9


def _mixed(h: Any) -> Any:
    """h's bits spread over all 64 (a splitmix64 step, in place)."""
    import numpy as np

    h ^= h >> np.uint64(31)
    h *= np.uint64(_MIX)
    h ^= h >> np.uint64(29)
    return h


def _id_hashes(chunk: pa.Array) -> Any:
    """A 64-bit hash of each id of a chunk (any value where null): equal ids, equal hashes, as Arrow
    compares them (0.0 and -0.0 alike). None for ids of other types (lists, structs)."""
    import numpy as np

    t, n = chunk.type, len(chunk)
    if pa.types.is_string(t) or pa.types.is_binary(t) or pa.types.is_large_string(t) or pa.types.is_large_binary(t):
        bufs = chunk.buffers()
        kind = np.int64 if pa.types.is_large_string(t) or pa.types.is_large_binary(t) else np.int32
        offsets = np.frombuffer(bufs[1], kind)[chunk.offset : chunk.offset + n + 1].astype(np.int64)
        data = np.frombuffer(bufs[2], np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
        return _bytes_hashes(offsets, data)
    if pa.types.is_floating(t):
        x = chunk.fill_null(0).to_numpy(zero_copy_only=False).astype(np.float64) + 0.0  # -0.0 becomes 0.0
        return _mixed(x.view(np.uint64))
    if pa.types.is_boolean(t):
        return _mixed(chunk.fill_null(False).to_numpy(zero_copy_only=False).astype(np.uint64))
    try:  # other fixed-width values (ints, dates, times, decimals, fixed-size binary) by their bytes
        width = t.bit_width // 8 if t.bit_width % 8 == 0 else 0
    except ValueError:  # lists, structs, ...
        return None
    if not width or t.num_fields or pa.types.is_interval(t) or len(chunk.buffers()) != 2:
        return None
    data = np.frombuffer(chunk.buffers()[1], np.uint8)[chunk.offset * width : (chunk.offset + n) * width]
    if width in (1, 2, 4, 8):
        return _mixed(data.view(f"<u{width}").astype(np.uint64))
    return _matrix_hashes(data.reshape(n, width), np.full(n, width, np.int64))


def _bytes_hashes(offsets: Any, data: Any) -> Any:
    """Hashes of variable-length values given by Arrow offsets into data."""
    import numpy as np

    lengths = np.diff(offsets)
    n = len(lengths)
    longest = int(lengths.max()) if n else 0
    if n == 0 or longest == 0:
        return _mixed(lengths.astype(np.uint64))
    if n * longest > 1 << 26 and n > 1:  # a few long ids: halves, so the padded copy stays small
        half = n // 2
        return np.concatenate([_bytes_hashes(offsets[: half + 1], data), _bytes_hashes(offsets[half:], data)])
    base = int(offsets[0])
    if (lengths == longest).all():
        matrix = data[base : base + n * longest].reshape(n, longest)
    else:
        matrix = np.zeros((n, longest), np.uint8)
        row = np.repeat(np.arange(n), lengths)
        matrix[row, np.arange(len(row)) - np.repeat(offsets[:-1] - base, lengths)] = data[base : int(offsets[-1])]
    return _matrix_hashes(matrix, lengths)


def _matrix_hashes(matrix: Any, lengths: Any) -> Any:
    """Hashes of the rows of an (ids, bytes) matrix, 8 bytes at a time, each row's length mixed in."""
    import numpy as np

    n, width = matrix.shape
    words = np.zeros((n, -(-width // 8) * 8), np.uint8)
    words[:, :width] = matrix
    words = words.view(np.uint64)
    h = lengths.astype(np.uint64)
    for j in range(words.shape[1]):
        h = _mixed(h ^ words[:, j])
    return h


def _duplicates(values: pa.Array, rows: Any, limit: int, found: list[tuple[int, str]]) -> int:
    """Count the ids that repeat an earlier row's (rows ascending with them), and add the first `limit`."""
    import numpy as np

    if len(values) < 2:
        return 0
    # A stable sort: equal ids stay in row order, so each run of them starts at its first row.
    order = pc.sort_indices(values)
    ordered = values.take(order)
    row = rows[order.to_numpy()]
    del order
    starts = np.ones(len(row), dtype=bool)
    same = pc.equal(ordered.slice(1), ordered.slice(0, len(ordered) - 1))
    starts[1:] = ~same.fill_null(False).to_numpy(zero_copy_only=False)
    repeats = np.flatnonzero(~starts)
    if len(repeats):
        first = np.maximum.accumulate(np.where(starts, np.arange(len(row)), 0))
        for i in repeats[np.argsort(row[repeats], kind="stable")[:limit]]:
            value = ordered[int(i)].as_py()
            msg = f"duplicate id {value!r} in rows {int(row[first[i]])} and {int(row[i])}; ids must be unique"
            found.append((int(row[i]), msg))
    return len(repeats)


def _id_problems_python(chunks: IdChunks, limit: int, found: list[tuple[int, str]]) -> int:
    """Duplicates of ids Arrow cannot sort (lists, structs), one row at a time, the first `limit` added."""
    count = 0
    seen: dict[Any, int] = {}
    row = 0
    for chunk in chunks():
        for value in chunk.to_pylist():
            if value is not None:
                key = value if isinstance(value, (str, int, float, bytes)) else repr(value)
                if key in seen:
                    count += 1
                    if count <= limit:
                        found.append((row, f"duplicate id {value!r} in rows {seen[key]} and {row}; ids must be unique"))
                else:
                    seen[key] = row
            row += 1
    return count


def check_ids(path: Any, ids: Union[pa.ChunkedArray, IdChunks], column: str = "id") -> None:
    """Ids must be present and unique; the error names the first bad row, its id and the row it repeats."""
    count, shown = id_problems(ids, column, limit=1)
    if count:
        raise InputError(f"{path}: {shown[0]}")


def open_input(dest: Path) -> Any:
    """DIR/input as a dataset: the corpus it refers to (each file checked unchanged when first read),
    or the converted copy memory-mapped."""
    if is_reference(dest):
        return open_reference(dest)
    import datasets

    datasets.disable_progress_bars()
    return datasets.load_from_disk(str(dest))


def plan_shards(
    num_rows: int, num_shards: Optional[int], rows_per_shard: Optional[int], default_rows: int
) -> list[Shard]:
    """Split rows into contiguous shards, by count or by size."""
    if num_shards is not None:
        n = min(num_shards, num_rows)
        bounds = [num_rows * i // n for i in range(n + 1)]
    else:
        size = rows_per_shard or default_rows
        bounds = list(range(0, num_rows, size)) + [num_rows]
    return [Shard(i, a, b) for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False))]
