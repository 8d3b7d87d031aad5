"""The input format: as configured, else from the first file's suffix (an OpenAI batch file by its first line)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from batchinfer.errors import InputError
from batchinfer.inputs.compressed import COMPRESSION_SUFFIXES
from batchinfer.inputs.openai_batch import looks_like_openai_batch
from batchinfer.inputs.textfiles import first_line

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
