"""Durable writes: a file is whole under its name or absent (temporary, fsync, rename or link, fsync
of the folder), and a refused write (disk full, read-only) is a StorageError naming what to do."""

from __future__ import annotations

import errno
import json
import os
import re
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, Optional

from batchinfer import faults
from batchinfer.errors import CorruptRecord, StorageError
from batchinfer.redaction import plain_json, record_json
from batchinfer.security import record_mode

TMP_PREFIX = ".tmp-"


def fsync_dir(path: Path) -> None:
    """Make a rename in path durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# Errors that say the filesystem refuses writes; anything else is a bug and keeps its traceback.
STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}


def refused_write(e: OSError) -> Optional[int]:
    """The errno when e says the filesystem refuses writes (pyarrow puts it only in the text)."""
    if e.errno in STORAGE_ERRNOS:
        return e.errno
    found = re.search(r"\[Errno (\d+)\]", str(e))
    return int(found.group(1)) if found and int(found.group(1)) in STORAGE_ERRNOS else None


def storage_error(path: Path, e: OSError) -> StorageError:
    """A user-facing error for a write the filesystem refused."""
    code = refused_write(e)
    why = {
        errno.ENOSPC: "the disk is full",
        errno.EDQUOT: "the disk quota is exceeded",
        errno.EROFS: "the filesystem is read-only",
        errno.EFBIG: "the file is too large for the filesystem",
    }.get(code or 0, "permission denied")
    return StorageError(
        f"cannot write {path}: {why} ({os.strerror(code or errno.EACCES)}). Nothing already committed was changed; "
        f"free space or fix the permissions of {path.parent}, then run the same command again "
        f"(or `batchinfer resume DIR` for a Slurm run): only the missing rows are redone"
    )


def temporary_name(path: Path) -> Path:
    """A temporary name beside path, unique to this writer, that no reader takes for a part or output."""
    return path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}")


def atomic_write(
    path: Path, data: bytes, points: Optional[faults.WritePoints] = None, mode: Optional[int] = None
) -> None:
    """Write data under a temporary name, fsync, rename into place, fsync the folder (points: its
    fault points, for tests; mode: the file's, else the umask's).

    A refused write (disk full, read-only) removes the temporary and raises StorageError."""
    tmp = temporary_name(path)
    try:
        _write_temporary(tmp, data, points, mode)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as e:
        raise _write_failed(tmp, path, e) from None
    if points:
        faults.point(points.after_rename)


def publish_new(folder: Path, name: Callable[[int], str], first: int, data: bytes, points: faults.WritePoints) -> Path:
    """Write data as a new file under the first free name(first), name(first + 1), ...: an existing
    file is never replaced (os.link fails on an existing name, where a rename would overwrite it)."""
    tmp = temporary_name(folder / name(first))
    n = first
    try:
        _write_temporary(tmp, data, points)
        while not _link_new(tmp, folder / name(n)):
            n += 1
        _unlink_temporary(tmp)
        fsync_dir(folder)
    except OSError as e:
        raise _write_failed(tmp, folder / name(n), e) from None
    faults.point(points.after_rename)
    return folder / name(n)


def create_once(path: Path, data: bytes) -> bool:
    """Write data as path unless path exists; True if this call created it (first writer wins)."""
    return publish_stream(path, lambda f: f.write(data))


def _link_new(tmp: Path, path: Path) -> bool:
    """Give tmp the name path if that name is free; False if another file has it."""
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        # NFS: a retransmitted LINK can answer EEXIST although it succeeded (open(2)); then the
        # name is our file and these bytes are already published. Judged by the file the name
        # leads to, not by st_nlink, which a stale attribute cache can still show as 1 (and the
        # same bytes would be published again under the next name).
        return _same_file(tmp, path)


def _same_file(a: Path, b: Path) -> bool:
    """Whether two names lead to one file."""
    sa, sb = os.stat(a), os.stat(b)
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def _unlink_temporary(tmp: Path) -> None:
    """Drop the temporary name of a published file. NFS: a retransmitted REMOVE answers ENOENT
    although the first one removed it; the file is published either way."""
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass


def publish_stream(
    path: Path,
    fill: Callable[[BinaryIO], None],
    points: Optional[faults.WritePoints] = None,
    replace: Optional[Path] = None,
) -> bool:
    """Write a file by fill(file) under a temporary name, fsync, then give it the name path: as a
    new name (False if path exists: first writer wins), or over `replace` (== path) when the new
    file holds everything the old one did. The temporary is removed on a refused write."""
    tmp = temporary_name(path)
    try:
        with open(tmp, "wb") as f:
            fill(_FaultingFile(f, points.in_write) if points else f)
            f.flush()
            os.fsync(f.fileno())
        if points:
            faults.point(points.before_rename)
        if replace is not None:
            os.replace(tmp, path)
            created = True
        else:
            created = _link_new(tmp, path)
            _unlink_temporary(tmp)
        fsync_dir(path.parent)
    except OSError as e:
        raise _write_failed(tmp, path, e) from None
    if points:
        faults.point(points.after_rename)
    return created


class _FaultingFile:
    """A file whose first write stops half way at a fault point (tests)."""

    def __init__(self, f: BinaryIO, point: str):
        self.f = f
        self.point = point
        self.first = True

    def write(self, data: bytes) -> int:
        if self.first and len(data) > 1:
            self.first = False
            self.f.write(data[: len(data) // 2])
            self.f.flush()
            faults.point(self.point)
            self.f.write(data[len(data) // 2 :])
            return len(data)
        return self.f.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.f, name)


def _write_temporary(tmp: Path, data: bytes, points: Optional[faults.WritePoints], mode: Optional[int] = None) -> None:
    # Made with its mode, never wider for a moment: the umask can only narrow it.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666 if mode is None else mode)
    with os.fdopen(fd, "wb") as f:
        if points:
            f.write(data[: len(data) // 2])
            f.flush()
            faults.point(points.in_write)
            f.write(data[len(data) // 2 :])
        else:
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if points:
        faults.point(points.before_rename)


def _write_failed(tmp: Path, path: Path, e: OSError) -> OSError:
    """The error to raise for a failed write: StorageError when the filesystem refuses writes
    (the temporary removed), else e itself (the temporary is left for the next writer to remove)."""
    if refused_write(e) is None:
        return e
    try:
        tmp.unlink(missing_ok=True)
    except OSError:
        pass  # read-only: the temporary (if any) is removed by the next writer
    return storage_error(path, e)


def write_json(path: Path, obj: Any, redact: bool = True) -> None:
    """Atomically write a JSON record, redacted (redaction.record_json). redact=False only for a
    record of batchinfer's own state holding no config value (tests/contract lists them): a
    field such as an ownership mark's `token` is a name, not a secret."""
    if redact:
        write_record(path, record_json(obj, indent=2, sort_keys=True, default=str) + "\n")
    else:
        atomic_write(path, (plain_json(obj) + "\n").encode())


def write_record(path: Path, text: str) -> None:
    """Atomically write a record already redacted (redaction.record_json, record_yaml), owner-only
    when it marks a secret's place (security.record_mode)."""
    atomic_write(path, text.encode(), mode=record_mode(path.parent, text))


def read_json(path: Path, advice: str = "") -> Any:
    """A JSON record (the one reader of batchinfer's records); CorruptRecord naming the file, where
    it stops being JSON and advice (what to do) when it is not JSON."""
    data = path.read_bytes()
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise corrupt_record(path, f"not UTF-8 text (byte {e.start})", advice) from None
    except json.JSONDecodeError as e:
        raise corrupt_record(path, f"not valid JSON: {e.msg} at line {e.lineno} column {e.colno}", advice) from None


def corrupt_record(path: Path, what: str, advice: str = "") -> CorruptRecord:
    """The error for a record of batchinfer's that is not what it wrote."""
    return CorruptRecord(
        f"{path} is {what}; batchinfer writes it whole (a temporary renamed into place), so something "
        f"else changed or cut it: {advice or 'restore it from a copy'}"
    )
