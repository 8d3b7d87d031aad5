"""Parquet and Arrow corpora referenced in place: DIR/input/reference.json, the manifest naming each
file with its size, mtime and footer digest, planned from footers and headers alone (referenced.py reads it)."""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa

from batchinfer.inputs.file_layout import (
    arrow_layout,
    file_stat,
    footer_digest,
    ipc_batches,
    ipc_reader,
    parquet_footer,
    parquet_metadata,
)

log = logging.getLogger("batchinfer")

MANIFEST = "reference.json"
REFERENCED_FORMATS = ("parquet", "arrow", "hf_disk")
ID_BATCH_ROWS = 1 << 18


def data_files(files: list[Path], fmt: str) -> list[Path]:
    """The files holding the rows: the inputs themselves, or a `save_to_disk` folder's Arrow files."""
    if fmt != "hf_disk":
        return files
    state = json.loads((files[0] / "state.json").read_text(encoding="utf-8"))
    return [files[0] / entry["filename"] for entry in state["_data_files"]]


def _schemas_agree(first: pa.Schema, other: pa.Schema) -> bool:
    return first.remove_metadata().equals(other.remove_metadata())


def _datasets_reads_as_is(schema: pa.Schema) -> bool:
    """Whether `datasets` would give these columns the same types and plain Python values (no JSON
    fields it decodes): then rows read here equal the rows of a converted copy."""
    import datasets

    try:
        features = datasets.Features.from_arrow_schema(schema)
        same = features.arrow_schema.remove_metadata().equals(schema.remove_metadata())
    except Exception:  # a type `datasets` cannot hold: the conversion decides, in its own words
        return False
    try:
        from datasets.utils.json import get_json_field_paths_from_feature

        same = same and not list(get_json_field_paths_from_feature(features))
    except ImportError:  # older `datasets`: no JSON fields
        pass
    return same


def plan_reference(files: list[Path], fmt: str) -> Optional[dict[str, Any]]:
    """The manifest of a corpus read in place (footers and headers only), or None where it must be
    converted: files whose schemas differ, types `datasets` would change, compressed Arrow."""
    if fmt not in REFERENCED_FORMATS:
        return None
    try:
        # prepare fingerprints the input, then converts it: the footers are read once, for files
        # whose names, sizes and mtimes are still those of the first reading
        key = (fmt, tuple((str(f), *file_stat(f)) for f in data_files(files, fmt)))
        if key not in _PLANS:
            _PLANS.clear()  # one corpus per process is what is asked for
            _PLANS[key] = _plan(files, fmt)
        plan = _PLANS[key]
        return copy.deepcopy(plan) if plan is not None else None
    except (pa.ArrowException, OSError, ValueError, KeyError):
        return None  # not what its suffix says, unreadable: converting reports why, in the reader's words


_PLANS: dict[tuple[Any, ...], Optional[dict[str, Any]]] = {}


def _plan(files: list[Path], fmt: str) -> Optional[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    schema: Optional[pa.Schema] = None
    for path in data_files(files, fmt):
        size, mtime = file_stat(path)
        if fmt == "parquet":
            footer = parquet_footer(path)
            parsed = parquet_metadata(footer)
            meta = parsed.metadata
            digest = footer_digest(footer)
            pieces = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
            file_schema = parsed.schema_arrow
        else:
            digest, pieces, file_schema, compressed = arrow_layout(path)
            if compressed:
                log.info("%s: compressed Arrow: converted once into the run directory", path)
                return None
        if schema is None:
            schema = file_schema
        elif not _schemas_agree(schema, file_schema):
            log.info("%s: its schema differs from %s's: the files are converted", path, records[0]["path"])
            return None
        records.append(
            {
                "path": str(path),
                "size": size,
                "mtime_ns": mtime,
                "digest": digest,
                "rows": sum(pieces),
                "pieces": pieces,
            }
        )
    if schema is None or not _datasets_reads_as_is(schema):
        return None
    return {
        "version": 1,
        "format": "parquet" if fmt == "parquet" else "arrow",
        "rows": sum(r["rows"] for r in records),
        "schema": base64.b64encode(schema.serialize().to_pybytes()).decode(),
        "files": records,
    }


def reference_fingerprint(manifest: dict[str, Any], files: list[Path]) -> str:
    """The corpus identity: each data file's name, size and footer (or IPC layout) digest, and the
    bytes of a saved dataset's small JSON files; not paths or mtimes, so a move or a `touch` keeps it."""
    h = hashlib.blake2b(digest_size=16)
    h.update(b"reference-v1")
    for rec in manifest["files"]:
        h.update(json.dumps([Path(rec["path"]).name, rec["size"], rec["digest"]]).encode())
    for folder in (f for f in files if f.is_dir()):
        for name in ("state.json", "dataset_info.json"):
            h.update(name.encode())
            h.update((folder / name).read_bytes())
    return h.hexdigest()


def manifest_schema(manifest: dict[str, Any]) -> pa.Schema:
    """The corpus' Arrow schema, as the manifest holds it."""
    return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(manifest["schema"])))


def write_manifest(manifest: dict[str, Any], dest: Path) -> None:
    """DIR/input as a folder holding only the manifest."""
    dest.mkdir(parents=True)
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")


def is_reference(dest: Path) -> bool:
    """Whether DIR/input refers to a corpus in place (rather than holding a converted copy)."""
    return (dest / MANIFEST).is_file()


def manifest_ids(manifest: dict[str, Any], column: str) -> Iterable[pa.Array]:
    """The id column, batch by batch, reading that column only."""
    for rec in manifest["files"]:
        yield from _file_column(manifest["format"], Path(rec["path"]), column)


def _file_column(fmt: str, path: Path, column: str) -> Iterator[pa.Array]:
    import pyarrow.parquet as pq

    if fmt == "parquet":
        with pq.ParquetFile(str(path)) as pf:
            for batch in pf.iter_batches(batch_size=ID_BATCH_ROWS, columns=[column]):
                yield batch.column(0)
    else:
        with pa.memory_map(str(path)) as mapped:
            for batch in ipc_batches(ipc_reader(mapped)):
                yield batch.column(column)
