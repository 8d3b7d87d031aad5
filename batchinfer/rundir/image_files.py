"""The image files a run's rows name (prompt.image_column paths and file:// URLs, an OpenAI
request's image_url file), recorded at prepare in DIR/images.json with each file's size, mtime and
content digest; a reopen or resume whose files changed since is refused, naming them.

Cost: prepare digests every file (threads: hashlib hashes without holding the GIL, so several
files are read and hashed at once), one read of the image corpus beside the one the tasks make.
A check (reopen, resume) stats every file and digests only those whose size or mtime differ: a
touched or copied-back file whose bytes are the same is accepted (and its new stat recorded); a
file whose bytes differ, or that is gone or appeared, is a change. The digest is the request
digest's (requests/images.image_digest): output.reuse and dedup key on the same bytes.

Images held in the input (bytes, data: URLs) are covered by the input's fingerprint; http URLs
(prompt.image_http) are not recorded: what a server answers later is not checked."""

from __future__ import annotations

import logging
import os
from collections.abc import Collection, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from batchinfer.config.schema import PromptConfig
from batchinfer.durable import read_json, write_json
from batchinfer.errors import RunDirError
from batchinfer.logs import plural
from batchinfer.requests.images import ImageLimits, image_hasher, image_ref, open_regular
from batchinfer.requests.prompts import RowError
from batchinfer.rundir.image_cells import column_values as column_values
from batchinfer.rundir.image_cells import image_cells as image_cells
from batchinfer.rundir.image_cells import image_column_of as image_column_of
from batchinfer.rundir.image_cells import is_json_text as is_json_text
from batchinfer.rundir.store import IMAGES_FILE as RECORD
from batchinfer.rundir.store import RunDir

log = logging.getLogger("batchinfer")

SHOWN = 5  # changed files a refusal names; the rest are counted
CHUNK = 1 << 20  # bytes read and hashed at a time: 8 threads hold 8 MiB, whatever the files' sizes
THREADS = 8  # files hashed at once (network filesystems answer faster to several readers)


@dataclass(frozen=True)
class ImageFile:
    """One image file as prepare saw it: its size and mtime, and the digest of its bytes (None:
    it could not be read then, its rows being error rows of kind image)."""

    path: str
    size: int
    mtime_ns: int
    digest: Optional[str]

    def to_list(self) -> list[Any]:
        """Its DIR/images.json entry."""
        return [self.path, self.size, self.mtime_ns, self.digest]

    @classmethod
    def from_list(cls, entry: list[Any]) -> ImageFile:
        """An entry of DIR/images.json."""
        path, size, mtime_ns, digest = entry
        return cls(str(path), int(size), int(mtime_ns), digest)


def image_paths(values: Iterable[Any], column: str, limits: ImageLimits) -> list[str]:
    """The distinct files the column's values name (paths, file:// URLs, `datasets` {path} without
    bytes), sorted; values that name no file (bytes, data: URLs, http URLs, nulls) are left out."""
    paths = set()
    for value in values:
        if value is None:
            continue
        try:
            ref = image_ref(value, column, limits)
        except RowError:
            continue  # that row's error row says why; it names no file
        if ref.path is not None:
            paths.add(str(ref.path))
    return sorted(paths)


def _stat(path: str) -> tuple[int, int]:
    try:
        st = os.stat(path)
    except OSError:
        return -1, -1
    return st.st_size, st.st_mtime_ns


def _digest(path: str, max_bytes: int) -> Optional[str]:
    """The file's digest, read CHUNK bytes at a time; None where it is no regular file (a FIFO, a
    device: never opened blocking, never read), cannot be read, or has more than max_bytes (its rows
    are error rows at run time, as the worker finds)."""
    try:
        fd = open_regular(Path(path))
    except OSError:  # NotRegular too
        return None
    with os.fdopen(fd, "rb") as f:
        if os.fstat(fd).st_size > max_bytes:
            return None
        h, seen = image_hasher(), 0
        while chunk := f.read(CHUNK):
            seen += len(chunk)
            if seen > max_bytes:  # grew since the fstat
                return None
            h.update(chunk)
        return h.hexdigest()


def scan(paths: list[str], max_bytes: int, previous: Optional[dict[str, ImageFile]] = None) -> list[ImageFile]:
    """Each file's stat and digest (a file whose size and mtime are previous's keeps its digest
    unread; one over max_bytes, or no regular file, has none); hashed THREADS at a time."""
    previous = previous or {}
    stats = {p: _stat(p) for p in paths}

    def known(p: str) -> Optional[ImageFile]:
        old = previous.get(p)
        return old if old is not None and stats[p][0] >= 0 and (old.size, old.mtime_ns) == stats[p] else None

    todo = [p for p in paths if known(p) is None and stats[p][0] >= 0]
    digests: dict[str, Optional[str]] = {}
    if todo:
        with ThreadPoolExecutor(min(THREADS, len(todo)), thread_name_prefix="batchinfer-image-digest") as pool:
            digests = dict(zip(todo, pool.map(lambda p: _digest(p, max_bytes), todo), strict=True))
    out = []
    for p in paths:
        old = known(p)
        out.append(ImageFile(p, *stats[p], old.digest if old is not None else digests.get(p)))
    return out


def write_record(run_path: Path, files: list[ImageFile]) -> None:
    """DIR/images.json: every image file of the run (written only where rows name image files)."""
    write_json(run_path / RECORD, {"files": [f.to_list() for f in files]})


def read_record(run_path: Path) -> Optional[list[ImageFile]]:
    """DIR/images.json's files, or None where the run has no such record (no image files, or made before it)."""
    path = run_path / RECORD
    if not path.is_file():
        return None
    record = read_json(path, f"restore it, or start a new run in another output.dir than {run_path}")
    return [ImageFile.from_list(e) for e in record["files"]]


def _change(old: ImageFile, new: ImageFile) -> Optional[str]:
    if old.digest == new.digest:
        return None
    if new.digest is None:
        return f"{old.path} (gone or unreadable)"
    if old.digest is None:
        return f"{old.path} (unreadable at prepare, there now)"
    return f"{old.path} (contents changed: {old.size:,} -> {new.size:,} bytes)"


def _max_bytes(run_path: Path) -> int:
    """The run's prompt.image_max_bytes (the default where its run.yaml cannot say)."""
    try:
        return int(RunDir(run_path).config.prompt.image_max_bytes)
    except Exception:  # an older run.yaml: the refusal it deserves comes from the caller's own checks
        return PromptConfig().image_max_bytes


def image_changes(run_path: Path, redone: Optional[Collection[int]] = None) -> list[str]:
    """The image files of DIR/images.json whose bytes differ now (or that are gone or appeared), each
    with what changed. A changed file is no change where every row naming it is redone (`redone`, a
    redo's row numbers: the redo reads its new bytes), or holds a committed result that read no old
    bytes: an image error row, or an answer from a pass whose own images.json holds the new bytes.
    Only files touched (same bytes) or answered from their new bytes by committed rows are recorded
    with their new stat: a file let through for the redone rows keeps its old entry until the pass
    that reads it is merged (a redo that fails, or is stopped, leaves the record as it was)."""
    old = read_record(run_path)
    if not old:
        return []
    now = scan([f.path for f in old], _max_bytes(run_path), {f.path: f for f in old})
    changed = {a.path: c for a, b in zip(old, now, strict=True) if (c := _change(a, b)) is not None}
    pending: set[str] = set()  # changed files only redone rows still have to read
    if changed:
        digests = {f.path: f.digest for f in now if f.path in changed}
        unread, by_redone = _rows_from_old_bytes(run_path, digests, redone or ())
        pending = by_redone - unread
        changed = {p: c for p, c in changed.items() if p in unread}
    if not changed:
        record = [a if a.path in pending else b for a, b in zip(old, now, strict=True)]
        if record != old:
            write_record(run_path, record)  # touched (same bytes), or answered from the new bytes
    return list(changed.values())


def _rows_from_old_bytes(
    run_path: Path, digests: dict[str, Optional[str]], redone: Collection[int]
) -> tuple[set[str], set[str]]:
    """Of the changed files (path: digest now): those a row outside `redone` names whose committed
    result may come from the old bytes (or that has none yet), and those a row in `redone` names."""
    from batchinfer.inputs.convert import open_input

    run = RunDir(run_path)
    ds = open_input(run.input_dir)
    column = image_column_of(run.config.prompt.image_column, ds.column_names)
    if column is None or column not in ds.column_names:
        return set(), set()
    limits = ImageLimits.of(run.config.prompt, run.config.input.path)
    rows = set(int(r) for r in redone)
    kept: dict[int, str] = {}  # row: the changed file it names
    by_redone: set[str] = set()
    for i, value in enumerate(column_values(ds, column)):
        if value is None:
            continue
        try:
            ref = image_ref(value, column, limits)
        except RowError:
            continue
        if ref.path is not None and str(ref.path) in digests:
            if i in rows:
                by_redone.add(str(ref.path))
            else:
                kept[i] = str(ref.path)
    unread = set(kept.values())
    # DIR's committed results say which rows read no old bytes once its own shards are done (a
    # redo's are; a reopen or resume of a run half done has rows still to read: any change counts)
    if kept and all(run.shard_folder(s.index).is_done() for s in run.shards()):
        unread = _answered_from_old_bytes(run, kept, digests)
    return unread, by_redone


def _answered_from_old_bytes(run: RunDir, kept: dict[int, str], digests: dict[str, Optional[str]]) -> set[str]:
    """The files of `kept` (row: file) some row of which has no committed result read from the
    file's bytes now: an answer of DIR's own shards or of a pass that read other bytes, or none yet."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from batchinfer.rundir import passes
    from batchinfer.rundir.splice import merged_view

    seen: set[int] = set()
    out: set[str] = set()
    records: dict[int, dict[str, Optional[str]]] = {}
    rows = pa.array(list(kept), pa.int64())
    for table in merged_view(run):
        table = table.filter(pc.is_in(table.column("row"), value_set=rows))
        if not table.num_rows:
            continue
        kinds = pc.struct_field(table.column("error"), "kind").to_pylist()
        for row, number, kind in zip(
            table.column("row").to_pylist(), table.column(passes.PASS_COLUMN).to_pylist(), kinds, strict=True
        ):
            seen.add(row)
            path = kept[row]
            if kind == "image":  # an error row: it read no bytes to answer from
                continue
            if number not in records:
                got = read_record(passes.pass_path(run, number)) if number else None
                records[number] = {f.path: f.digest for f in got or []}
            if digests[path] is None or records[number].get(path) != digests[path]:
                out.add(path)
    out.update(path for row, path in kept.items() if row not in seen)
    return out


def refuse_changed_images(run_path: Path, redone: Optional[Collection[int]] = None) -> None:
    """RunDirError naming the image files that changed since the run was prepared (the first few and
    the count); with `redone`, those only the redone rows name are let through (image_changes)."""
    changes = image_changes(run_path, redone)
    if not changes:
        return
    shown = "; ".join(changes[:SHOWN]) + (f"; and {len(changes) - SHOWN} more" if len(changes) > SHOWN else "")
    rows = "rows this redo keeps" if redone is not None else "the run's rows"
    advice = (
        "restore the files, redo every row naming them too, or start a new run in another output.dir"
        if redone is not None
        else "restore the files, or start a new run in another output.dir"
    )
    raise RunDirError(
        f"{run_path}: {len(changes)} image file{'s' if len(changes) != 1 else ''} {rows} name changed since "
        f"it was prepared ({run_path / RECORD}): {shown}. Rows answered from the old images and rows answered "
        f"from the new ones would mix; {advice}"
    )


def record_images(run_path: Path, config: Any, ds: Any) -> None:
    """DIR/images.json: the image files the rows name, digested (a reopen or resume checks them)."""
    column = image_column_of(config.prompt.image_column, ds.column_names)
    if column is None or column not in ds.column_names:
        return
    limits = ImageLimits.of(config.prompt, config.input.path)
    paths = image_paths(column_values(ds, column), column, limits)
    if paths:
        files = scan(paths, limits.max_bytes)
        write_record(run_path, files)
        log.info("%s digested (%s)", plural(len(files), "image file"), run_path / RECORD)
