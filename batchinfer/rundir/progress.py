"""A shard's progress record (progress.json, and the counting part of DONE.json): the one reader and
writer of it, the compatibility with older records, and the failure budget (cluster.max_attempts)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, NamedTuple, NotRequired, Optional, TypedDict

from batchinfer import slurm_env
from batchinfer.durable import read_json, write_json
from batchinfer.locks import holder_info
from batchinfer.locks.holder import HolderRecord

# Version 2 writes `schema`; a record without it is version 1 (read the same way: every key that
# version 1 could lack reads as what that version meant by its absence).
SCHEMA = 2
PHASES = ("startup", "prepare", "generate", "commit")  # seconds a task holds its GPUs, by what it does
SERIES_POINTS = 500  # a record keeps at most this many {t, rows_done, output_tokens} points
RATE_KEYS = ("output_tokens_per_s", "total_tokens_per_s", "rows_per_s", "prefix_cache_hit_rate")


class EngineSlot(TypedDict):
    """Which of its task's engines runs the shards (cluster.engines_per_task), as progress.json
    records it: engine `index` of `of`, on `devices` (GPU indices, or `cpu:` and cores)."""

    index: int
    of: int
    devices: Optional[str]  # None: not a string in the record read (engine_record)
    # the engine's start-up seconds: it starts before it takes a shard, so its shards' own start-up
    # phase (seconds.startup) is about 0 (tune/trial.py reads it)
    startup_seconds: NotRequired[float]


class SecondsRecord(TypedDict, total=False):
    """`seconds` of progress.json: by phase (PHASES; `prepare` absent from older records)."""

    startup: float
    prepare: float
    generate: float
    commit: float


class PrefixCacheRecord(TypedDict):
    """`prefix_cache` of progress.json."""

    queries: int
    hits: int


class SeriesPoint(TypedDict):
    """One point of progress.json's `series`, written at each commit (charts read them)."""

    t: float
    rows_done: int
    output_tokens: int


class ProgressRecord(TypedDict, total=False):
    """progress.json as Progress.to_dict and write_progress write it (schema 2); an older record
    lacks some keys (Progress.from_dict reads what each version meant by their absence). DONE.json
    holds the same keys and more (done.py)."""

    shard: int
    rows_total: int
    rows_done: int
    parts: int
    prompt_tokens: int
    output_tokens: int
    errors: dict[str, int]
    reused_rows: int
    attempts: int
    failures: int
    failures_by_job: dict[str, int]
    suspects: dict[str, int]  # row (as a JSON key) -> engine deaths it was in flight at
    crashed: dict[str, int]
    seconds: SecondsRecord
    prefix_cache: Optional[PrefixCacheRecord]
    adapter_loads: int  # LoRA runs only
    series: list[SeriesPoint]
    first_request_seconds: float
    updated: float
    holder: HolderRecord
    engine: EngineSlot
    last_error: str
    schema: int
    output_tokens_per_s: Optional[float]
    total_tokens_per_s: Optional[float]
    rows_per_s: Optional[float]
    prefix_cache_hit_rate: Optional[float]


@dataclass
class Seconds:
    """Seconds of a shard's attempts so far, by phase (PHASES)."""

    startup: float = 0.0
    prepare: float = 0.0  # absent from records older than the prepare phase
    generate: float = 0.0
    commit: float = 0.0


@dataclass
class PrefixCache:
    """Prompt tokens sent to the engine and those it served from its prefix cache."""

    queries: int = 0
    hits: int = 0


class Rates(NamedTuple):
    """Rates over generate seconds (None before any), and the prefix-cache hit rate (None: not reported)."""

    output_tokens_per_s: Optional[float]
    total_tokens_per_s: Optional[float]
    rows_per_s: Optional[float]
    prefix_cache_hit_rate: Optional[float]


def rates(
    prompt_tokens: int, output_tokens: int, rows_done: int, generate_s: float, cache: Optional[PrefixCache]
) -> Rates:
    """Output and total (prompt + output) tokens/s and rows/s over generate seconds, and the hit rate."""
    return Rates(
        output_tokens_per_s=round(output_tokens / generate_s, 2) if generate_s else None,
        total_tokens_per_s=round((prompt_tokens + output_tokens) / generate_s, 2) if generate_s else None,
        rows_per_s=round(rows_done / generate_s, 2) if generate_s else None,
        prefix_cache_hit_rate=round(cache.hits / cache.queries, 4) if cache and cache.queries else None,
    )


@dataclass
class Progress:
    """A shard's counts (rebuilt from its committed parts at each attempt), the attempts and failures
    carried over between attempts, and who wrote it last. progress.json holds it as a JSON object
    with these names (the rates added); DONE.json holds it plus what reproduces the rows (`extra`)."""

    shard: Optional[int] = None
    rows_total: Optional[int] = None
    rows_done: int = 0
    parts: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    errors: dict[str, int] = field(default_factory=dict)  # error rows by kind
    # rows answered from output.reuse (rebuilt from the parts' `reused` column); a record without it
    # is from a version that reused nothing: 0
    reused_rows: int = 0
    attempts: int = 0
    failures: int = 0
    # cluster.max_attempts counts per submission (budget_key); None: a record from before that
    failures_by_job: Optional[dict[str, int]] = None
    # rows in flight when the engine died, with how often; done rows drop out
    suspects: dict[int, int] = field(default_factory=dict)
    # digest (hex) of a request the engine died on alone -> its row: identical requests are error rows
    crashed: dict[str, int] = field(default_factory=dict)
    seconds: Seconds = field(default_factory=Seconds)
    prefix_cache: Optional[PrefixCache] = None  # None: the engine does not report it
    # LoRA adapters the engine moved into one of its max_loras slots for this shard's requests, over
    # its attempts (each a load of an adapter's weights); None: a run without adapters, or a record
    # from before this count
    adapter_loads: Optional[int] = None
    series: list[SeriesPoint] = field(default_factory=list)  # one point per commit, for charts
    first_request_seconds: Optional[float] = None
    # Read from the file, written by write_progress (not carried from one attempt to the next):
    updated: Optional[float] = None
    holder: Optional[HolderRecord] = None
    engine: Optional[EngineSlot] = None  # which of its task's engines, as read (engine_record checks it)
    last_error: Optional[str] = None
    schema: int = SCHEMA  # the version of the record read (1: no `schema` key); written as SCHEMA
    extra: dict[str, Any] = field(default_factory=dict)  # keys this version does not know, kept as read

    @classmethod
    def from_dict(cls, d: ProgressRecord) -> Progress:
        """A record as read from progress.json or DONE.json, of any version."""
        known = _KNOWN
        cache = d.get("prefix_cache")
        seconds = d.get("seconds") or {}
        return cls(
            **{k: d[k] for k in known - _TYPED if d.get(k) is not None},
            suspects={int(r): n for r, n in (d.get("suspects") or {}).items()},
            seconds=Seconds(**{p: float(seconds[p]) for p in PHASES if p in seconds}),
            prefix_cache=PrefixCache(cache["queries"], cache["hits"]) if cache else None,
            schema=d.get("schema", 1),
            extra={k: v for k, v in d.items() if k not in known and k not in RATE_KEYS},
        )

    def to_dict(self) -> ProgressRecord:
        """The record as written: the keys older versions read, the rates, and `schema`."""
        out: ProgressRecord = dict(self.extra)  # type: ignore[assignment]
        for f in fields(self):
            value = getattr(self, f.name)
            # absent rather than null: an older writer's setdefault would keep a null
            if f.name not in _TYPED and f.name != "extra" and value is not None:
                out[f.name] = value
        out.update(
            schema=SCHEMA,
            suspects={str(r): n for r, n in self.suspects.items()},
            seconds=asdict(self.seconds),
            prefix_cache=asdict(self.prefix_cache) if self.prefix_cache else None,
            **self.rates()._asdict(),
        )
        return out

    def rates(self) -> Rates:
        """This record's rates over its generate seconds."""
        return rates(self.prompt_tokens, self.output_tokens, self.rows_done, self.seconds.generate, self.prefix_cache)

    @property
    def device(self) -> Optional[str]:
        """The hardware that ran the shard (DONE.json only)."""
        return self.extra.get("device")

    def add_point(self) -> None:
        """Append a time-series point; past SERIES_POINTS, every other point goes (first and last stay)."""
        self.series.append(
            {"t": round(time.time(), 1), "rows_done": self.rows_done, "output_tokens": self.output_tokens}
        )
        if len(self.series) > SERIES_POINTS:
            self.series[:] = self.series[:-1:2] + self.series[-1:]

    def failures_in(self, key: str) -> int:
        """Failed attempts counted against budget `key` (older records: every failure counted)."""
        return self.failures_by_job.get(key, 0) if self.failures_by_job is not None else self.failures


_TYPED = {"suspects", "seconds", "prefix_cache", "schema"}  # converted by from_dict/to_dict themselves
_KNOWN = {f.name for f in fields(Progress)} - {"extra"}


def read_progress(path: Path) -> Optional[Progress]:
    """The record in path (progress.json or DONE.json); None when there is none."""
    return Progress.from_dict(read_json(path)) if path.is_file() else None


def write_progress(path: Path, record: Progress, error: Optional[str], engine: Optional[EngineSlot]) -> None:
    """Write a shard's progress.json: the record, when and by whom (and which engine of the task), the
    error of this write if any (a write without one leaves out an error only an earlier record had)."""
    out = dict(record.to_dict(), updated=time.time(), holder=holder_info())
    if engine:
        out["engine"] = engine
    if error:
        out["last_error"] = error
    write_json(path, out)


def count_failure(
    path: Path, shard: int, error: str, record: Optional[Progress] = None, engine: Optional[EngineSlot] = None
) -> int:
    """Count a failed attempt of a shard in its progress.json, in all and against this submission's
    budget (a requeued task keeps its job id); the caller holds the shard lock. record: the shard's
    current one (None: read it from path). Returns the failures in this budget."""
    if record is None:
        record = read_progress(path) or Progress(shard=shard)
    record.failures += 1
    by_job = record.failures_by_job = record.failures_by_job or {}
    key = budget_key()
    by_job[key] = by_job.get(key, 0) + 1
    write_progress(path, record, error, engine)
    return by_job[key]


def engine_record(rec: Any) -> Optional[EngineSlot]:
    """A shard's `engine` record ({index, of, devices}: which of a task's engines ran it), or None when
    absent (a single-engine run) or not of that shape."""
    if not isinstance(rec, dict):
        return None
    index, of = rec.get("index"), rec.get("of")
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (index, of)) or not 0 <= index < of:
        return None
    devices = rec.get("devices")
    return EngineSlot(index=index, of=of, devices=devices if isinstance(devices, str) else None)


def budget_key(job: Optional[str] = None) -> str:
    """Whose failures count against cluster.max_attempts: the submission (Slurm array, or job) of
    `job` (ARRAY_TASK or JOB, as jobs.jsonl records it), else of this process; `local` outside Slurm."""
    if job is not None:
        return job.split("_")[0]
    return slurm_env.current().submission or "local"
