"""Putting a merged output in place: the record of what a merge writes, the check that an existing
output is a merge's own, leftovers of killed merges, and the rename (a folder: by swapping names)."""

from __future__ import annotations

import os
from pathlib import Path

from batchinfer import faults
from batchinfer.durable import TMP_PREFIX, fsync_dir, read_json
from batchinfer.errors import RunDirError
from batchinfer.rundir.store import RunDir
from batchinfer.security import remove_path


def remove_merge_leftovers(run: RunDir) -> None:
    """Under the merge lock: what killed merges left (temporary outputs, `-cache`/`-hf` staging)."""
    name = run.output_path.name
    for p in run.path.iterdir():
        if p.name.startswith(TMP_PREFIX) and p.name.endswith((name, f"{name}-cache", f"{name}-hf")):
            remove_path(p)


# The output a merge is putting in place (its name and files), until stats.json records it.
MERGING = ".merging.json"


def check_own_output(run: RunDir, out: Path) -> None:
    """RunDirError unless out is absent or what a merge of this run wrote: stats.json (or the record
    of a merge killed before writing it) names it, and a folder holds only the files it names."""
    if not out.exists() and not out.is_symlink():
        return
    merging = run.path / MERGING
    advice = f"it is an unfinished merge's record: remove it and {out.name}, then `batchinfer merge {run.path}`"
    for rec in (run.stats() or {}, read_json(merging, advice) if merging.is_file() else {}):
        if rec.get("output") != out.name:
            continue
        if not out.is_dir() or out.is_symlink():
            return
        extra = sorted({str(p.relative_to(out)) for p in out.rglob("*") if not p.is_dir()} - set(rec["files"]))
        if not extra:
            return
        raise RunDirError(
            f"{out} holds files no merge of this run wrote ({', '.join(extra[:5])}); merge replaces the "
            f"whole folder, so move them away, then merge again"
        )
    raise RunDirError(
        f"{out} was not written by a merge of this run ({run.stats_json.name} does not name it); merge "
        f"would replace it, so move it away, then merge again"
    )


def put_in_place(tmp: Path, out: Path) -> None:
    """Put the finished output in place: a file atomically, a folder by swapping names."""
    if tmp.is_dir() and out.exists():
        old = tmp.with_name(tmp.name[: -len(out.name)] + "old-" + out.name)
        remove_path(old)
        os.replace(out, old)
        faults.point(faults.IN_MERGE_SWAP)
        os.replace(tmp, out)
        remove_path(old)
    else:
        os.replace(tmp, out)
    fsync_dir(out.parent)
