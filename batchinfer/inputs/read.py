"""Open inputs (files, globs, compressed, saved datasets), convert them once to Arrow, plan shards."""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa

from batchinfer.errors import InputError
from batchinfer.inputs.openai_batch import convert_requests, looks_like_openai_batch
from batchinfer.inputs.textfiles import COMPRESSION_SUFFIXES, first_line, open_text, scan_jsonl, text_lines
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


def file_fingerprint(files: list[Path], previous: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Content hash of every input file; reused when names, sizes and mtimes match the previous record."""
    members = sorted(f for p in files for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file())
    stats = [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in members]
    if previous and previous.get("files") == stats:
        return previous
    h = hashlib.blake2b(digest_size=16)
    for f in members:
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            while block := fh.read(1 << 20):
                h.update(block)
    return {"files": stats, "size": sum(s[1] for s in stats), "fingerprint": h.hexdigest()}


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
        return datasets.Dataset.from_json(names, cache_dir=cache)
    if fmt in ("csv", "tsv"):
        return datasets.Dataset.from_csv(names, cache_dir=cache, sep="\t" if fmt == "tsv" else ",")
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
    """Convert the input once into an Arrow dataset at dest; return its row count. With strict_ids=False
    null or duplicate ids are left for the caller to report (`batchinfer validate`). local_cache puts
    `datasets`' cache (and its file locks) in a node-local temporary folder instead of beside dest."""
    shown = str(files[0]) if len(files) == 1 else f"{files[0].parent}/ ({len(files)} files)"
    if all(f.is_file() and f.stat().st_size == 0 for f in files):
        raise InputError(f"{shown}: no rows (the file is empty); there is nothing to run")
    tmp = dest.with_name(dest.name + ".tmp")
    remove_path(tmp, ignore_errors=True)
    if local_cache:
        cache = Path(tempfile.mkdtemp(prefix="batchinfer-convert-"))
    else:
        cache = dest.with_name(".hf-cache")
        remove_path(cache, ignore_errors=True)  # a symlink here would send datasets' cache outside DIR
    try:
        try:
            ds = _load(files, fmt, cache, shown)
        except InputError:
            raise
        except Exception as e:  # the readers raise ValueError, OSError, ArrowException, DatasetGenerationError
            raise _read_error(files, fmt, shown, e) from None
        if len(ds) == 0:
            raise InputError(f"{shown}: no rows; there is nothing to run")
        if id_column is not None:
            if id_column not in ds.column_names:
                raise InputError(
                    f"{shown}: input.id_column={id_column!r} is not a column (columns: {', '.join(ds.column_names)})"
                )
            if strict_ids:
                check_ids(shown, ds.data.column(id_column), id_column)
        for col in columns or []:
            column_type(ds.data.schema, col, shown)
        ds.save_to_disk(str(tmp))
        os.replace(tmp, dest)
        return len(ds)
    finally:
        remove_path(cache, ignore_errors=True)
        remove_path(tmp, ignore_errors=True)


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


def id_problems(ids: pa.ChunkedArray, column: str, limit: int = 5) -> tuple[int, list[str]]:
    """Null and duplicate ids: how many rows have one, and the first `limit` said as messages."""
    count, shown = 0, []
    seen: dict[Any, int] = {}
    for row, value in enumerate(ids.to_pylist()):
        if value is None:
            msg = f"row {row}: input.id_column {column!r} is null or missing; every row needs an id"
        elif value in seen:
            msg = f"duplicate id {value!r} in rows {seen[value]} and {row}; ids must be unique"
        else:
            seen[value] = row
            continue
        count += 1
        if len(shown) < limit:
            shown.append(msg)
    return count, shown


def check_ids(path: Any, ids: pa.ChunkedArray, column: str = "id") -> None:
    """Ids must be present and unique; the error names the id and its rows."""
    count, shown = id_problems(ids, column, limit=1)
    if count:
        raise InputError(f"{path}: {shown[0]}")


def open_input(dest: Path) -> Any:
    """Memory-map the converted input dataset."""
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
