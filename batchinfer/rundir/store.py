"""The run directory on disk: run.yaml, the plan, the schema, the output path (one shard's folder:
shard_folder.py; locks: locks/)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, TypedDict

import pyarrow as pa
import yaml

from batchinfer.config.compose import LITERAL_KEYS, LITERAL_LIST_KEYS
from batchinfer.config.schema import Config, to_config
from batchinfer.durable import corrupt_record, read_json, write_record
from batchinfer.errors import RunDirError
from batchinfer.inputs.shards import Shard
from batchinfer.models.identity import IdentityRecord
from batchinfer.ownership import Layout
from batchinfer.redaction import ENV_REF, REDACTED, exact_yaml, is_secret_name, struck_by_older
from batchinfer.rundir.schema import schema_from_text
from batchinfer.rundir.shard_folder import ShardFolder
from batchinfer.security import check_secret_values

OUTPUT_EXT = {"jsonl": "jsonl", "openai": "jsonl", "parquet": "parquet", "hf": "parquet"}
FILES_DIR = "files"  # frozen copies of the files the config names
IMAGES_FILE = "images.json"  # the image files rows name, with their digests (rundir/image_files.py)
# What a prepare of an older batchinfer wrote first into the folder it was making, removed once
# run.yaml was there: such a folder is its own, half made.
PREPARING = ".batchinfer-preparing"
# What prepare makes at the top of the run directory it claims (ownership.claim), older versions'
# prepares included: all a failed prepare, or one adopting a killed prepare's folder, may remove.
# Any other name in a half-made run directory is the user's: the folder is refused, naming it.
PREPARE_LAYOUT = Layout(
    "run directory",
    (
        "run.yaml",
        "plan.json",
        "input",
        "input.tmp",  # the input being converted (inputs/convert.py)
        ".hf-cache",  # `datasets`' cache while converting
        FILES_DIR,
        IMAGES_FILE,
        ".tmp-*",  # durable writes' temporaries
        PREPARING,
        ".batchinfer-write-test-*",  # prepare's write probe
    ),
)


# run.yaml's `redaction` when its config holds exactly what runs but secret-named keys' values
# (redaction.exact): written by prepare and by a reopen, which write a config composed now. A run.yaml
# without it is an older version's, whose text redaction may have struck free text (K7).
EXACT_RECORD = "exact"


def _resolve_secret_refs(text: str) -> str:
    """`${oc.env:NAME}` references to secret-named variables (what a record may hold by design)
    resolved from this environment where it has them; any other is left as the text it is."""
    return ENV_REF.sub(lambda m: os.environ.get(m[1], m[0]) if is_secret_name(m[1]) else m[0], text)


def _resolved(obj: Any, key: str = "") -> Any:
    """run.yaml's config with its secret references resolved from this environment. Values taken as
    typed (prompt.template, prompt.system, sampling.stop, ...) are the user's text, `${oc.env:...}`
    included, and reach every task the same; so does a reference to a variable that is no secret
    (attack42b K1: each task filled in its own value, or kept the text when it had none)."""
    if isinstance(obj, str):
        return obj if key in LITERAL_KEYS or key in LITERAL_LIST_KEYS else _resolve_secret_refs(obj)
    if isinstance(obj, dict):
        return {k: _resolved(v, f"{key}.{k}" if key else str(k)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_resolved(v, key) for v in obj]
    return obj


class InputRecord(TypedDict, total=False):
    """run.yaml's `input`: the input's identity (inputs/fingerprint.py), where it is, and its rows."""

    files: list[list[Any]]  # [name, size, mtime_ns] of each file
    size: int
    fingerprint: str
    method: str  # `footers` for a corpus read in place; absent: a content hash
    path: str
    format: str
    rows: int


class FrozenFile(TypedDict):
    """A file the config names, frozen into DIR/files (run.yaml's `files`, by config key)."""

    source: str
    path: str  # relative to DIR
    sha256: str


class OutputSchema(TypedDict):
    """run.yaml's `output_schema`: the columns for people, the Arrow schema for the code."""

    columns: dict[str, str]
    arrow: str


class RunRecord(TypedDict, total=False):
    """run.yaml, as prepare writes it and read_run_yaml reads it (the keys of RUN_KEYS always
    there; `model_identity` and `files` absent from older ones)."""

    batchinfer: str  # the version that prepared it
    redaction: str  # EXACT_RECORD; absent: an older version's, whose config may hold struck text
    created: str
    host: str
    fingerprint: str
    fingerprint_keys: dict[str, Any]  # the flat key -> value map of config/fingerprint.py
    model_identity: IdentityRecord
    files: dict[str, FrozenFile]
    input: InputRecord
    output_schema: OutputSchema
    versions: dict[str, str]
    config: dict[str, Any]  # the resolved config as plain containers (config/schema.to_dict)


# What every run.yaml batchinfer writes holds (prepare.py): without them it is not one it can read.
RUN_KEYS = {"config": dict, "input": dict, "fingerprint_keys": dict, "output_schema": dict}


def read_run_yaml(path: Path) -> RunRecord:
    """A run.yaml batchinfer wrote; RunDirError in one line saying what the file is instead
    (another tool's, an older format, not YAML) rather than a traceback further on."""
    try:
        run = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise RunDirError(
            f"{path} is not a run.yaml batchinfer wrote: it is not YAML ({str(e).splitlines()[0]})"
        ) from None
    except UnicodeDecodeError:
        raise RunDirError(f"{path} is not a run.yaml batchinfer wrote: it is not text") from None
    if not isinstance(run, dict):
        raise RunDirError(
            f"{path} is not a run.yaml batchinfer wrote: it holds a YAML {type(run).__name__}, not a mapping"
        )
    if "batchinfer" not in run:
        keys = ", ".join(map(str, list(run)[:6])) or "none"
        raise RunDirError(
            f"{path} is not a run.yaml batchinfer wrote: it has no `batchinfer` version (its keys: {keys}); "
            f"another tool's file? Use another folder"
        )
    bad = [k for k, kind in RUN_KEYS.items() if not isinstance(run.get(k), kind)]
    if bad:
        raise RunDirError(
            f"{path} was written by batchinfer {run['batchinfer']} in a format this version cannot read "
            f"(no {', '.join(bad)}); prepare the run again in a new output.dir"
        )
    return run


def struck_keys(record: RunRecord) -> list[str]:
    """The config keys of an older version's run.yaml (no `redaction` mark) holding text its text
    redaction struck: `<redacted>` where only a secret-named key's value is struck now, or, in a value
    taken as typed, a `${oc.env:NAME}` of a secret variable it wrote over the secret's value (tasks
    then resolved it; they run it as typed now). None in a run.yaml marked exact: there such text is
    what the user typed."""
    if record.get("redaction") == EXACT_RECORD:
        return []
    c = record["config"]
    found = struck_by_older(c)
    for key in (*LITERAL_KEYS, *LITERAL_LIST_KEYS):
        group, _, name = key.partition(".")
        value = (c.get(group) or {}).get(name) if isinstance(c.get(group), dict) else None
        texts = value if isinstance(value, list) else [value]
        refs = [n for t in texts if isinstance(t, str) for n in ENV_REF.findall(t)]
        if any(is_secret_name(n) for n in refs) and key not in found:
            found.append(key)
    return found


def refuse_struck(path: Path, record: RunRecord) -> None:
    """RunDirError naming the keys of run.yaml an older version struck (struck_keys), and what to
    do: a task would run `<redacted>` where the user typed a value."""
    keys = struck_keys(record)
    if not keys:
        return
    fp = record.get("fingerprint_keys") or {}
    outputs = [k for k in keys if any(k == f or k.startswith(f + ".") for f in fp)]
    if outputs:  # resume refuses a key that changes outputs
        how = (
            f"prepare the run again with the original values in a new output.dir (`batchinfer run ... "
            f"output.dir=NEW`): {', '.join(outputs)} change{'s' if len(outputs) == 1 else ''} outputs"
        )
    else:
        given = " ".join(f"{k}=..." for k in keys)
        how = f"give the original values again: `batchinfer resume {path} {given}`"
    mark = f"add the line `redaction: {EXACT_RECORD}` to {path}/run.yaml"
    if "redaction" in record:  # a line is there, with another value (EXACT, true): say which
        value = record.get("redaction")
        # as YAML writes the scalar: true, false, null, 2
        shown = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
        mark = (
            f"change the line `redaction: {shown}` of {path}/run.yaml to `redaction: {EXACT_RECORD}` "
            f"(exactly, in lower case)"
        )
    raise RunDirError(
        f"{path}/run.yaml was written by an older batchinfer, which struck text out of {', '.join(keys)} "
        f"({REDACTED} or ${{oc.env:...}} in place of what was typed), so a task would run that text; {how}; "
        f"or, if that text is what you typed (a prompt that asks for {REDACTED}), {mark} and the run takes "
        f"it as it is"
    )


class RunDir:
    """Paths and records of one run directory."""

    def __init__(self, path: Path | str):
        self.path = Path(path).expanduser().resolve()
        self.run_yaml = self.path / "run.yaml"
        self.plan_json = self.path / "plan.json"
        self.input_dir = self.path / "input"
        self.shards_dir = self.path / "shards"
        self.logs_dir = self.path / "logs"
        self.stats_json = self.path / "stats.json"
        self._run: Optional[RunRecord] = None
        self._schema: Optional[pa.Schema] = None
        self._config: Optional[Config] = None
        self._runnable = False  # refuse_struck found nothing in run.yaml as read

    def exists(self) -> bool:
        """Whether run.yaml has been written."""
        return self.run_yaml.is_file()

    @property
    def run(self) -> RunRecord:
        """run.yaml, read once."""
        if self._run is None:
            if not self.exists():
                raise RunDirError(f"{self.path}: not a run directory (no run.yaml)")
            self._run = read_run_yaml(self.run_yaml)
        return self._run

    def write_run(self, record: RunRecord) -> None:
        """Write run.yaml atomically, exactly what runs but a secret-named key's value
        (redaction.exact_yaml); the record as given is kept in memory. Refused (ConfigError) when the
        config holds a secret's value (security.check_secret_values), paths as resolved included."""
        check_secret_values(record["config"])
        write_record(self.run_yaml, exact_yaml(record))
        self._run = record
        self._config = None
        self._runnable = False

    @property
    def recorded_config(self) -> Config:
        """The run's frozen config, typed (run.yaml's `config`), its references to secret variables
        (`${oc.env:NAME}`) resolved from this environment: the latest moment, where it is used.
        The cluster settings keep theirs: the sbatch scripts leave them to the task's shell.
        For what reads settings and runs nothing (status, report, merge); what runs reads `config`."""
        if self._config is None:
            c = self.run["config"]
            self._config = to_config({k: v if k == "cluster" else _resolved(v, k) for k, v in c.items()})
        return self._config

    @property
    def config(self) -> Config:
        """The config a task, a submission, a resume or a redo runs (recorded_config), refused when
        run.yaml was written by an older version and holds text its redaction struck (refuse_struck)."""
        if not self._runnable:
            refuse_struck(self.path, self.run)
            self._runnable = True
        return self.recorded_config

    @property
    def schema(self) -> pa.Schema:
        """The run's output schema."""
        if self._schema is None:
            self._schema = schema_from_text(self.run["output_schema"]["arrow"])
        return self._schema

    @property
    def output_format(self) -> str:
        """jsonl, parquet, openai or hf."""
        return self.recorded_config.output.format

    @property
    def part_format(self) -> str:
        """Parts are JSONL for JSONL output, else Parquet."""
        return "jsonl" if self.output_format == "jsonl" else "parquet"

    @property
    def output_split(self) -> Optional[int]:
        """output.max_rows_per_file: the merged output as several files of at most this many rows."""
        return self.recorded_config.output.max_rows_per_file

    @property
    def output_path(self) -> Path:
        """Where merge writes the dataset: output.<ext>, or the folder DIR/output (split files, or
        a `save_to_disk` dataset for output.format=hf)."""
        if self.output_format == "hf" or self.output_split:
            return self.path / "output"
        return self.path / f"output.{OUTPUT_EXT[self.output_format]}"

    def shards(self) -> list[Shard]:
        """The shard plan from plan.json (CorruptRecord naming it when it is not prepare's)."""
        advice = (
            "it is the run's shard plan, written once by prepare; restore it from a copy, or start the run "
            "again in a new output.dir"
        )
        if not self.plan_json.is_file():
            self.run  # noqa: B018  (a folder without run.yaml, or with another tool's, is refused as such)
            raise RunDirError(f"{self.plan_json} is missing; {advice}")
        plan = read_json(self.plan_json, advice)
        try:
            return [Shard(int(s["index"]), int(s["start"]), int(s["stop"])) for s in plan["shards"]]
        except (KeyError, TypeError, ValueError):
            raise corrupt_record(
                self.plan_json, "not a shard plan (no shards with index, start, stop)", advice
            ) from None

    def stats(self) -> Optional[dict[str, Any]]:
        """stats.json, what the last merge wrote (None: none yet); CorruptRecord naming it and what to do."""
        if not self.stats_json.is_file():
            return None
        out = self.output_path.name
        advice = f"merge writes it again: remove it and {out}, then `batchinfer merge {self.path}`"
        stats = read_json(self.stats_json, advice)
        if not isinstance(stats, dict):
            raise corrupt_record(self.stats_json, f"a JSON {type(stats).__name__}, not merge's record", advice)
        return stats

    def shard_dir(self, index: int) -> Path:
        """Folder of one shard's parts and markers (its files and their protocol: shard_folder)."""
        return self.shards_dir / f"{index:05d}"

    def shard_folder(self, index: int) -> ShardFolder:
        """One shard's folder: its parts, progress.json, DONE.json, reads, commits and seal."""
        return ShardFolder(self, index)

    def shard(self, index: int) -> Shard:
        """One shard of the plan."""
        for s in self.shards():
            if s.index == index:
                return s
        raise RunDirError(f"{self.plan_json}: no shard {index}")
