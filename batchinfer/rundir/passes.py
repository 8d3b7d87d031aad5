"""Passes of `batchinfer redo`: DIR/passes/N/, each a run directory of its own over some rows of DIR,
its record (pass.json), the rows it answers (selection.parquet), and which passes are finished and
merged into DIR's output."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchinfer import ownership
from batchinfer.durable import read_json
from batchinfer.durable import write_record as write_text_record
from batchinfer.errors import RunDirError
from batchinfer.locks.holder import Verdict
from batchinfer.ownership import Found, Kind
from batchinfer.redaction import exact_json, strike_override
from batchinfer.rundir.store import PREPARE_LAYOUT, RunDir

PASSES_DIR = "passes"
PASS_JSON = "pass.json"
# The selected input rows, in input order, with their row number in DIR's input: the pass's input.
SELECTION = "selection.parquet"
SOURCE_ROW = "_batchinfer_row"
PASS_COLUMN = "pass"
PASS_FIELD = pa.field(PASS_COLUMN, pa.int32(), nullable=False)
MERGED_PASSES = "merged_passes"  # stats.json: the passes a merge took, whatever rows they kept
# What a redo makes in DIR/passes/N while it makes the pass (ownership.claim): its record, its
# selection, and the pass's run directory as prepare makes it.
LAYOUT = ownership.Layout("redo pass", (*PREPARE_LAYOUT.names, PASS_JSON, SELECTION))


@dataclass(frozen=True)
class PassRecord:
    """DIR/passes/N/pass.json: what made the pass (the same where and overrides reopen it)."""

    number: int
    where: str
    overrides: list[str]
    config_dir: Optional[str]
    rows: int  # rows selected
    created: str

    def same_command(self, where: str, overrides: list[str], config_dir: Optional[str]) -> bool:
        """Whether a redo command is the one that made this pass: the where text and the overrides as
        typed (pass.json holds them so; only a secret-named key's value is struck, on both sides)."""
        typed = [strike_override(o) for o in overrides]
        return (self.where, list(self.overrides), self.config_dir) == (where, typed, config_dir)

    def describe(self) -> str:
        """`--where '...' overrides` as typed."""
        return " ".join([f"--where {self.where!r}", *self.overrides])

    def describe_args(self) -> list[str]:
        """The redo command's arguments after DIR."""
        config_dir = ["--config-dir", self.config_dir] if self.config_dir else []
        return ["--where", self.where, *config_dir, *self.overrides]


def overridden_sampling(c: dict[str, Any], overrides: list[str]) -> list[str]:
    """The sampling keys a redo's overrides name, when DIR's rows carry sampling of their own
    (input.sampling_column, an OpenAI Batch input): the overrides win over the rows' own values
    for those keys (input.sampling_overridden), as a user who types them expects."""
    if not (c["input"].get("sampling_column") or c["input"].get("format") == "openai"):
        return []
    named = (ov.lstrip("+~").partition("=")[0].split(".") for ov in overrides)
    return sorted({parts[1] for parts in named if len(parts) > 1 and parts[0] == "sampling"})


def pass_path(root: RunDir, number: int) -> Path:
    """DIR/passes/N."""
    return root.path / PASSES_DIR / str(number)


def pass_numbers(root: RunDir) -> list[int]:
    """The numbers of DIR's passes that have a pass.json, ascending."""
    folder = root.path / PASSES_DIR
    if not folder.is_dir():
        return []
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit() and (p / PASS_JSON).is_file())


def read_record(path: Path) -> PassRecord:
    """A pass folder's pass.json."""
    rec = read_json(path / PASS_JSON)
    return PassRecord(
        rec["number"], rec["where"], list(rec["overrides"]), rec.get("config_dir"), rec["rows"], rec["created"]
    )


def write_record(path: Path, number: int, where: str, overrides: list[str], config_dir: Optional[str]) -> PassRecord:
    """Write pass.json (rows unknown yet: -1) into a new pass folder."""
    rec = PassRecord(number, where, list(overrides), config_dir, -1, time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    _write(path, asdict(rec))
    return rec


def set_rows(path: Path, rows: int) -> None:
    """Record how many rows the pass selected."""
    rec = read_json(path / PASS_JSON)
    rec["rows"] = rows
    _write(path, rec)


def _write(path: Path, rec: dict[str, Any]) -> None:
    """pass.json, read back to run the pass: exactly as typed but a secret-named key's value."""
    write_text_record(path / PASS_JSON, exact_json(rec, indent=2, sort_keys=True, default=str) + "\n")


def is_pass(run: RunDir) -> bool:
    """Whether run is a pass of another run directory (DIR/passes/N)."""
    parent = run.path.parent
    return (run.path / PASS_JSON).is_file() and parent.name == PASSES_DIR and (parent.parent / "run.yaml").is_file()


def root_of(run: RunDir) -> RunDir:
    """The run directory a pass belongs to."""
    return RunDir(run.path.parent.parent)


def legacy_kind(path: Path) -> Optional[Kind]:
    """What a pass folder an older batchinfer made (no owner's mark) is: made once its run.yaml is
    there, half made with pass.json and only names a redo makes (ownership.recognise); anything else
    is not a pass."""
    if not (path / PASS_JSON).is_file():
        return None
    return Kind.DONE if (path / "run.yaml").is_file() else Kind.HALF_MADE


def recognise(path: Path) -> Found:
    """What a pass folder is: made, being made by a live redo, half made by a dead one, ..."""
    return ownership.recognise(path, legacy=legacy_kind, layout=LAYOUT)


def being_made(root: RunDir, number: int, found: Found) -> RunDirError:
    """The refusal of a pass folder another command is making (or that is not a pass)."""
    alive = found.judged is None or found.judged.verdict is Verdict.ALIVE
    if found.kind is Kind.MAKING and found.mark is not None and alive:
        return RunDirError(
            f"pass {number} of {root.path} is being made by {found.mark.describe()}; wait for it to finish"
        )
    return ownership.refusal(found, f"pass {number} of {root.path}:")


def is_finished(path: Path) -> bool:
    """A pass whose run directory is prepared and whose every shard is done."""
    run = RunDir(path)
    return run.exists() and all(run.shard_folder(s.index).is_done() for s in run.shards())


def finished_passes(root: RunDir) -> list[RunDir]:
    """Passes 1.. up to the first that is not finished: what merge puts into DIR's output."""
    out = []
    for number in pass_numbers(root):
        if not is_finished(pass_path(root, number)):
            break
        out.append(RunDir(pass_path(root, number)))
    return out


def unfinished_pass(root: RunDir) -> Optional[int]:
    """The first pass that is not finished, if any."""
    for number in pass_numbers(root):
        if not is_finished(pass_path(root, number)):
            return number
    return None


def merged_passes(root: RunDir) -> Optional[list[int]]:
    """The passes DIR's current output holds (stats.json), or None when there is no current output."""
    stats = root.stats()
    if stats is None or not root.output_path.exists():
        return None
    if stats.get("fingerprint") != root.run["fingerprint"]:
        return None
    if MERGED_PASSES in stats:
        return sorted(stats[MERGED_PASSES])
    # written before merged_passes was: the passes with rows in the output (a pass every row of
    # which a later one answered again is missing, so such an output is merged again once)
    return sorted(int(k) for k in stats.get("passes", {"0": 0}) if k != "0")


def output_is_current(root: RunDir) -> bool:
    """DIR's output is there and holds every finished pass."""
    return merged_passes(root) == [int(p.path.name) for p in finished_passes(root)]


def source_rows(run: RunDir) -> np.ndarray:
    """A pass's row i is row source_rows(run)[i] of DIR's input."""
    with pq.ParquetFile(run.path / SELECTION) as f:
        return f.read(columns=[SOURCE_ROW]).column(SOURCE_ROW).to_numpy()


def check_schema(root: RunDir, run: RunDir) -> None:
    """RunDirError unless a pass's rows have DIR's output columns (its id and row are DIR's)."""
    ours = [f for f in root.schema if f.name not in ("row", "id")]
    theirs = [f for f in run.schema if f.name not in ("row", "id")]
    if ours == theirs:
        return
    a = {f.name: str(f.type) for f in ours}
    b = {f.name: str(f.type) for f in theirs}
    diff = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    shown = ", ".join(f"{k} ({a.get(k, 'absent')} -> {b.get(k, 'absent')})" for k in diff) or "column order"
    raise RunDirError(
        f"these overrides change the output's columns: {shown}; a pass's answers replace rows of "
        f"{root.path}'s output, so they must have its columns. Start a new run for this instead"
    )


def with_pass_column(schema: pa.Schema) -> pa.Schema:
    """DIR's output schema with the `pass` column (0 = DIR's own run, N = DIR/passes/N)."""
    return schema.append(PASS_FIELD)
