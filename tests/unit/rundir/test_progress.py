"""The progress record (rundir/progress.py): progress.json of older versions still reads, and a record
written by this version reads back the same and keeps every key older readers look for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchinfer.rundir.progress import (
    SCHEMA,
    PrefixCache,
    Progress,
    Seconds,
    budget_key,
    count_failure,
    read_progress,
    write_progress,
)

# Written by batchinfer at 913c1ea (before `schema`): a fake-engine shard of 12 rows whose engine
# died with rows 0-4, 6 and 7 in flight; row 5 was an error row (null text), committed on the way out.
V1 = """{
  "attempts": 1,
  "crashed": {},
  "errors": {
    "prompt": 1
  },
  "failures": 1,
  "failures_by_job": {
    "local": 1
  },
  "first_request_seconds": 0.009,
  "holder": {
    "boot_id": "876cd490-3721-4075-a4a9-15afbdbb182b",
    "host": "vm",
    "pid": 10406,
    "pid_ns": "pid:[4026531836]",
    "pid_start": 1924340,
    "since": 1796249147.1442308,
    "slurm_job": null
  },
  "last_error": "RuntimeError: vLLM engine core died",
  "output_tokens": 0,
  "output_tokens_per_s": null,
  "parts": 1,
  "prefix_cache": null,
  "prefix_cache_hit_rate": null,
  "prompt_tokens": 0,
  "rows_done": 1,
  "rows_per_s": null,
  "rows_total": 12,
  "seconds": {
    "commit": 0.012706304998573614,
    "generate": 0.0,
    "prepare": 0.01021565400151303,
    "startup": 1.1010000889655203e-05
  },
  "series": [
    {
      "output_tokens": 0,
      "rows_done": 0,
      "t": 1796249147.1
    },
    {
      "output_tokens": 0,
      "rows_done": 1,
      "t": 1796249147.1
    }
  ],
  "shard": 0,
  "suspects": {
    "0": 1,
    "1": 1,
    "2": 1,
    "3": 1,
    "4": 1,
    "6": 1,
    "7": 1
  },
  "total_tokens_per_s": null,
  "updated": 1796249147.144212
}
"""


def test_a_progress_json_of_an_older_version_reads_as_version_1(tmp_path: Path) -> None:
    path = tmp_path / "progress.json"
    path.write_text(V1)
    rec = read_progress(path)
    assert rec is not None and rec.schema == 1
    assert (rec.shard, rec.rows_total, rec.rows_done, rec.parts, rec.attempts, rec.failures) == (0, 12, 1, 1, 1, 1)
    assert rec.errors == {"prompt": 1} and rec.failures_by_job == {"local": 1} and rec.failures_in("local") == 1
    assert rec.suspects == {0: 1, 1: 1, 2: 1, 3: 1, 4: 1, 6: 1, 7: 1}  # rows, as numbers
    assert rec.seconds.prepare == 0.01021565400151303 and rec.prefix_cache is None
    assert rec.last_error == "RuntimeError: vLLM engine core died" and rec.holder["pid"] == 10406
    assert [p["rows_done"] for p in rec.series] == [0, 1] and rec.extra == {}


def test_the_oldest_records_lack_keys_and_read_as_that_version_meant() -> None:
    """Before prepare seconds, before per-submission budgets: every failure counts; a record a test
    or a count of a failure before any commit wrote has only a few keys."""
    rec = Progress.from_dict({"shard": 3, "rows_done": 0, "failures": 2, "seconds": {"startup": 1.5, "generate": 2.0}})
    assert rec.schema == 1 and rec.failures_by_job is None and rec.failures_in("77") == 2
    assert rec.seconds == Seconds(startup=1.5, prepare=0.0, generate=2.0, commit=0.0)
    assert Progress.from_dict({"shard": 0, "suspects": {"2": 1, "5": 1}}).suspects == {2: 1, 5: 1}


def test_a_record_round_trips_and_keeps_the_keys_older_readers_use(tmp_path: Path) -> None:
    path = tmp_path / "progress.json"
    rec = Progress(
        shard=4,
        rows_total=100,
        rows_done=40,
        parts=3,
        prompt_tokens=900,
        output_tokens=300,
        errors={"overlong": 2},
        attempts=2,
        failures=1,
        failures_by_job={"123": 1},
        suspects={17: 1},
        crashed={"ab" * 16: 9},
        seconds=Seconds(startup=3.0, prepare=1.0, generate=10.0, commit=0.5),
        prefix_cache=PrefixCache(queries=900, hits=450),
        first_request_seconds=0.25,
    )
    rec.add_point()
    engine = {"index": 1, "of": 2, "devices": "2,3"}
    write_progress(path, rec, "RuntimeError: boom", engine)
    raw = json.loads(path.read_text())
    assert raw["schema"] == SCHEMA == 2
    assert set(json.loads(V1)) <= set(raw)  # every key version 1 wrote is still there
    assert raw["suspects"] == {"17": 1} and raw["prefix_cache"] == {"queries": 900, "hits": 450}
    assert raw["output_tokens_per_s"] == 30.0 and raw["total_tokens_per_s"] == 120.0 and raw["rows_per_s"] == 4.0
    assert raw["prefix_cache_hit_rate"] == 0.5 and raw["engine"] == engine
    back = read_progress(path)
    assert back is not None and back.schema == SCHEMA
    assert (back.last_error, back.engine, back.holder is not None, back.updated is not None) == (
        "RuntimeError: boom",
        engine,
        True,
        True,
    )
    back.last_error = back.engine = back.holder = back.updated = None  # what the write added
    assert back == rec
    write_progress(path, back, None, None)  # a write without an error has no last_error
    assert "last_error" not in json.loads(path.read_text())


def test_a_key_of_a_newer_version_is_kept_when_a_failure_is_counted(tmp_path: Path) -> None:
    path = tmp_path / "progress.json"
    path.write_text(json.dumps({"schema": 3, "shard": 0, "rows_done": 5, "failures": 1, "newer": [1, 2]}))
    count_failure(path, 0, "RuntimeError: died")
    raw = json.loads(path.read_text())
    assert raw["newer"] == [1, 2] and raw["rows_done"] == 5 and raw["failures"] == 2
    assert raw["failures_by_job"] == {budget_key(): 1} and raw["last_error"] == "RuntimeError: died"


def test_the_failure_budget_key_is_the_submission(monkeypatch: pytest.MonkeyPatch) -> None:
    """One rule for the worker (this process's Slurm job) and status (a job id from jobs.jsonl)."""
    for name in ("SLURM_ARRAY_JOB_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    assert budget_key() == "local"
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "123")
    monkeypatch.setenv("SLURM_JOB_ID", "130")
    assert budget_key() == budget_key("123_7") == budget_key("123") == "123"
