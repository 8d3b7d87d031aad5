"""A model folder's identity: what its files are (names, sizes, contents), so that the same path
holding other weights (a fine-tune saved to the same place, a conversion to another dtype) is known
for another model. Recorded in run.yaml at prepare; request digests (output.reuse) key on it, and a
run whose model folder changed since is refused on resume, naming the files that changed.

Contents, by `model.identity`:
- `sampled` (the default): a file up to WHOLE_BYTES (config.json, tokenizer files, a weights index,
  a small model's weights) is hashed whole; a larger one (weight shards of many GB) by its size, its
  first HEAD_BYTES (a safetensors header and the first tensors) and SAMPLES blocks of SAMPLE_BYTES
  spread over the rest: a few MB read per shard keeps the check cheap on a 100 GB model on a network
  filesystem. A retrained or converted model changes every block; but a change of the same size that
  falls between the blocks (a fine-tune rewriting a few tensors of a large shard in place, the rest
  frozen) is not seen.
- `full`: every file hashed whole (the whole model read at prepare, resume and each task's start,
  about as much again as the engine reads to load it): any change of any byte is seen.
Hidden files (names starting with '.', e.g. a hub cache's or a lock's) are not the model's."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import NotRequired, Optional, TypedDict

WHOLE_BYTES = 16 << 20  # files up to this size are hashed whole
HEAD_BYTES = 1 << 20  # a larger file: its head (a safetensors header holds every tensor's name and place) ...
SAMPLES = 32  # ... and this many blocks spread evenly over the rest
SAMPLE_BYTES = 64 << 10
SAMPLED, FULL = "sampled", "full"
MODES = (SAMPLED, FULL)  # model.identity


class FileRecord(TypedDict):
    """One file of a model identity as run.yaml records it (under its name)."""

    size: int
    sha256: str
    whole: bool  # absent from records of before sampled digests: whole


class IdentityRecord(TypedDict):
    """run.yaml's `model_identity`: ModelIdentity.to_dict writes it, from_dict reads it."""

    folder: str
    mode: NotRequired[str]  # model.identity; absent from records of before it: sampled
    digest: str
    files: dict[str, FileRecord]


@dataclass(frozen=True)
class ModelFile:
    """One file of a model folder: its path inside it, size and content digest (whole or sampled)."""

    name: str
    size: int
    sha256: str
    whole: bool


@dataclass(frozen=True)
class ModelIdentity:
    """The files of a model folder; two identities are the same model when their digests are equal."""

    folder: str
    files: tuple[ModelFile, ...]
    mode: str = SAMPLED  # how large files were hashed (model.identity): a check hashes them the same way

    @property
    def digest(self) -> str:
        """One hash of every file's name, size and content digest (not of the folder's path)."""
        h = hashlib.sha256()
        for f in self.files:
            h.update(f"{f.name}\0{f.size}\0{f.sha256}\n".encode())
        return h.hexdigest()

    def to_dict(self) -> IdentityRecord:
        """The run.yaml record."""
        return {
            "folder": self.folder,
            "mode": self.mode,
            "digest": self.digest,
            "files": {f.name: {"size": f.size, "sha256": f.sha256, "whole": f.whole} for f in self.files},
        }

    @classmethod
    def from_dict(cls, d: IdentityRecord) -> ModelIdentity:
        """An identity from its run.yaml record."""
        files = tuple(
            ModelFile(name, int(v["size"]), str(v["sha256"]), bool(v.get("whole", True)))
            for name, v in sorted((d.get("files") or {}).items())
        )
        return cls(folder=str(d.get("folder", "")), files=files, mode=str(d.get("mode", SAMPLED)))

    def changes(self, now: ModelIdentity) -> list[str]:
        """How the folder `now` differs from this record, one phrase per file (empty: the same)."""
        old = {f.name: f for f in self.files}
        new = {f.name: f for f in now.files}
        out = [f"{n} is gone" for n in sorted(set(old) - set(new))]
        out += [f"{n} is new" for n in sorted(set(new) - set(old))]
        for n in sorted(set(old) & set(new)):
            a, b = old[n], new[n]
            if a.size != b.size:
                out.append(f"{n} changed size ({a.size} -> {b.size} bytes)")
            elif a.sha256 != b.sha256:
                out.append(f"{n} changed contents (sha256 {a.sha256[:12]} -> {b.sha256[:12]})")
        return out


def file_digest(path: Path, size: int, mode: str = SAMPLED) -> tuple[str, bool]:
    """(sha256, whole): of the whole file up to WHOLE_BYTES (any size in mode FULL), else of its
    size, head and SAMPLES blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= WHOLE_BYTES or mode == FULL:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
            return h.hexdigest(), True
        h.update(f"{size}\0".encode())
        h.update(f.read(HEAD_BYTES))
        step = (size - HEAD_BYTES - SAMPLE_BYTES) // SAMPLES
        for i in range(1, SAMPLES + 1):  # the last block ends at the file's end
            f.seek(HEAD_BYTES + i * step)
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest(), False


def model_identity(folder: Path, mode: str = SAMPLED) -> ModelIdentity:
    """The identity of a model folder (every file under it but hidden ones; symlinks followed, as a
    hub cache's snapshot links its blobs), its large files hashed as mode says (model.identity)."""
    files = []
    seen: set[str] = set()
    for root, dirs, names in os.walk(folder, followlinks=True):
        real = os.path.realpath(root)
        if real in seen:  # a link back up the tree: walked already
            dirs[:] = []
            continue
        seen.add(real)
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(names):
            if name.startswith("."):
                continue
            path = Path(root) / name
            if not path.is_file():
                continue
            size = path.stat().st_size
            digest, whole = file_digest(path, size, mode)
            files.append(ModelFile(path.relative_to(folder).as_posix(), size, digest, whole))
    return ModelIdentity(folder=str(folder), files=tuple(sorted(files, key=lambda f: f.name)), mode=mode)


def recorded_identity(d: Optional[IdentityRecord]) -> Optional[ModelIdentity]:
    """The model identity of run.yaml's record; None for a run prepared before identities were recorded."""
    return ModelIdentity.from_dict(d) if d else None
