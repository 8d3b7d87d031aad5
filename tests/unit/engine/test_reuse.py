"""output.reuse on the fake engine: request digests in the parts, the index of earlier answers, what
is refused, what changes a digest and what does not, and the count of reused rows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from support.corpus import read_output, write_rows
from support.fake_engine import FakeEngine, keyed
from support.runs import fake_model_dir

from batchinfer.config.compose import compose
from batchinfer.errors import ConfigError
from batchinfer.launch.local import run_shards
from batchinfer.requests.digest import RequestDigests
from batchinfer.requests.request import RequestKey
from batchinfer.rundir.merge import merge
from batchinfer.rundir.model_record import identity_digest
from batchinfer.rundir.prepare import prepare
from batchinfer.rundir.progress import Progress
from batchinfer.rundir.reuse import ReuseIndex, open_reuse_dir
from batchinfer.rundir.schema import DIGEST_COLUMN, REUSED_COLUMN, schema_to_text
from batchinfer.rundir.store import RunDir

ANSWER = ["text", "finish_reason", "prompt_tokens", "output_tokens", "error", DIGEST_COLUMN]


def rows_of(n: int, start: int = 0, word: str = "alpha") -> list[dict[str, Any]]:
    """n rows with distinct texts (so no two share a request), ids from start."""
    return [
        {"id": f"doc-{i:03d}", "text": f"{word} row {i} of the corpus", "topic": f"t{i % 3}"}
        for i in range(start, start + n)
    ]


def run_of(tmp_path: Path, name: str, rows: list[dict[str, Any]], *extra: str) -> tuple[RunDir, FakeEngine]:
    """Prepare, run and merge rows on a fresh fake engine; the run and the engine (what reached it)."""
    corpus = write_rows(tmp_path / f"{name}.jsonl", rows)
    overrides = [
        f"input.path={corpus}",
        f"model.path={fake_model_dir(tmp_path)}",
        f"output.dir={tmp_path / name}",
        "input.id_column=id",
        "output.commit_every_rows=4",
        *extra,
    ]
    run = prepare(compose(overrides))
    eng = FakeEngine()
    run_shards(run, [s.index for s in run.shards()], engine=keyed(eng, run))
    merge(run)
    return run, eng


def test_a_grown_corpus_sends_only_its_new_rows_and_keeps_the_old_answers(tmp_path: Path) -> None:
    old_rows = rows_of(12)
    first, _ = run_of(tmp_path, "first", old_rows, "sharding.num_shards=2")
    before = read_output(first.path)
    assert all(r[DIGEST_COLUMN] and r[REUSED_COLUMN] is False for r in before)
    # the same rows and 5 new ones, other shards, carried columns and output format: the same requests
    new_rows = rows_of(5, start=12, word="beta")
    second, eng = run_of(
        tmp_path,
        "second",
        old_rows + new_rows,
        "sharding.num_shards=3",
        "input.columns=[topic]",
        "output.format=jsonl",
        f"output.reuse={first.path}",
    )
    assert sorted(eng.added) == sorted(eng.ids(r["text"]) for r in new_rows)  # only the new rows reached it
    out = read_output(second.path)
    assert [r["row"] for r in out] == list(range(17)) and [r["id"] for r in out] == [
        r["id"] for r in old_rows + new_rows
    ]
    for r, old in zip(out[:12], before, strict=True):
        assert {k: r[k] for k in ANSWER} == {k: old[k] for k in ANSWER} and r[REUSED_COLUMN] is True
    for r, x in zip(out, old_rows + new_rows, strict=True):
        assert r["text"] == FakeEngine.answer(eng.ids(x["text"])) and r["input"] == {"topic": x["topic"]}
    assert [r[REUSED_COLUMN] for r in out[12:]] == [False] * 5
    done = [json.loads(second.shard_folder(s.index).done_path.read_text()) for s in second.shards()]
    assert sum(d["reused_rows"] for d in done) == 12 and sum(d["rows_done"] for d in done) == 17


def test_report_and_status_count_reused_rows(tmp_path: Path) -> None:
    from batchinfer.insight.report import build_report, format_report
    from batchinfer.insight.status import format_status, shard_status, summarize

    first, _ = run_of(tmp_path, "first", rows_of(6))
    second, _ = run_of(tmp_path, "second", rows_of(6) + rows_of(2, start=6, word="beta"), f"output.reuse={first.path}")
    report = build_report(second)
    assert report["totals"]["reused_rows"] == 6 and report["shards"][0]["reused_rows"] == 6
    assert "Reused: 6 of 8 rows" in format_report(report, [])
    records = shard_status(second, {})
    totals = summarize(records)
    assert totals["reused_rows"] == 6 and records[0]["reused_rows"] == 6
    assert "6 rows reused (output.reuse)" in format_status(second, records, totals)
    assert build_report(first)["totals"]["reused_rows"] == 0


def test_resumed_shard_counts_reused_rows_from_its_parts(tmp_path: Path) -> None:
    """The count is rebuilt from the parts' `reused` column: a progress.json that missed a commit
    (killed between the part and it) does not lose reused rows."""
    from batchinfer.engine.stopflag import StopFlag
    from batchinfer.engine.worker import ShardWorker

    first, _ = run_of(tmp_path, "first", rows_of(8))
    corpus = write_rows(tmp_path / "c2.jsonl", rows_of(8) + rows_of(4, start=8, word="beta"))
    ov = [
        f"input.path={corpus}",
        f"model.path={fake_model_dir(tmp_path)}",
        f"output.dir={tmp_path / 'second'}",
        "input.id_column=id",
        "output.commit_every_rows=4",
        f"output.reuse={first.path}",
    ]
    run = prepare(compose(ov))
    worker = ShardWorker(run, lambda: keyed(FakeEngine(), run), StopFlag())
    shard = run.shards()[0]
    worker.run_shard(shard)
    progress = run.shard_folder(0).done_path
    record = json.loads(progress.read_text())
    assert record["reused_rows"] == 8
    stale = Progress.from_dict({k: v for k, v in record.items() if k != "reused_rows"})
    assert stale.reused_rows == 0  # a record of an earlier version: it reused nothing
    rebuilt, _ = worker._record_from_parts(shard)
    assert rebuilt.reused_rows == 8


@pytest.mark.parametrize(
    ("change", "same"),
    [
        ("sampling.temperature=0.5", False),
        ("sampling.seed=7", False),
        ("sampling.max_tokens=17", False),
        ("model.seed=3", False),
        ("quantization.kv_cache_dtype=fp8", False),
        ("+model.engine_kwargs.hf_overrides={x: 1}", False),
        ("input.columns=[topic]", True),
        ("output.format=jsonl", True),
        ("sharding.num_shards=3", True),
        ("output.commit_every_rows=2", True),
        ("model.max_num_seqs=64", True),
        ("prompt.overlong=truncate_left", True),  # no row is overlong: the token ids sent are the same
    ],
)
def test_what_changes_a_request_digest(tmp_path: Path, change: str, same: bool) -> None:
    base = digests_of(tmp_path, "base")
    assert (digests_of(tmp_path, "changed", change) == base) is same


def test_digest_depends_on_model_dtype_token_ids_and_own_sampling(tmp_path: Path) -> None:
    base = digests_of(tmp_path, "base")
    other_model = tmp_path / "other-model"
    other_model.mkdir()
    (other_model / "config.json").write_text("{}")
    assert digests_of(tmp_path, "model", f"model.path={other_model}") != base
    keys = prepared(tmp_path, "dtype").run["fingerprint_keys"]
    key = RequestKey((1, 2, 3), "")
    one = RequestDigests(keys, "float32")
    assert one.of(key, "a") == one.of(key, "b")  # greedy: identical requests, one answer
    assert one.of(key, "a") != RequestDigests(keys, "bfloat16").of(key, "a")
    assert one.of(key, "a") != one.of(RequestKey((1, 2, 4), ""), "a")
    assert one.of(key, "a") != one.of(RequestKey((1, 2, 3), '{"seed": 5}'), "a")
    # unseeded random sampling: each row its own sample, reused for that row only
    alone = RequestKey((1, 2, 3), "", own_row=0)
    assert one.of(alone, "a") != one.of(alone, "b")


def prepared(tmp_path: Path, name: str, *extra: str) -> RunDir:
    """A prepared run of four fixed rows (nothing run)."""
    corpus = write_rows(tmp_path / "fixed.jsonl", rows_of(4))
    model = [f"model.path={fake_model_dir(tmp_path)}"] if not any(e.startswith("model.path") for e in extra) else []
    ov = [f"input.path={corpus}", *model, f"output.dir={tmp_path / name}", "input.id_column=id", *extra]
    return prepare(compose(ov))


def digests_of(tmp_path: Path, name: str, *extra: str) -> list[str]:
    """The request digests a run of the four fixed rows commits."""
    run = prepared(tmp_path, name, *extra)
    run_shards(run, [s.index for s in run.shards()], engine=keyed(FakeEngine(), run))
    tables = [run.shard_folder(s.index).read_rows([DIGEST_COLUMN, "row"]) for s in run.shards()]
    return pa.concat_tables(tables).sort_by("row").column(DIGEST_COLUMN).to_pylist()


def test_a_changed_temperature_reuses_nothing(tmp_path: Path) -> None:
    first, _ = run_of(tmp_path, "first", rows_of(6))
    second, eng = run_of(tmp_path, "second", rows_of(6), "sampling.temperature=0.5", f"output.reuse={first.path}")
    assert len(eng.added) == 6 and not any(r[REUSED_COLUMN] for r in read_output(second.path))


def test_reuse_is_not_in_the_fingerprint(tmp_path: Path) -> None:
    first, _ = run_of(tmp_path, "first", rows_of(4))
    other = prepared(tmp_path, "other")
    # the same directory reopens with output.reuse added (a list, or one path): the same run
    reusing = prepared(tmp_path, "other", f"output.reuse=[{first.path}]")
    assert reusing.path == other.path and reusing.run["fingerprint"] == other.run["fingerprint"]
    assert reusing.run["config"]["output"]["reuse"] == [str(first.path)]
    assert prepared(tmp_path, "other").run["fingerprint"] == other.run["fingerprint"]


def test_index_first_directory_wins_and_error_rows_are_not_answers(tmp_path: Path) -> None:
    rows = rows_of(4)
    rows[2]["text"] = None  # an error row: no request, no digest
    a, _ = run_of(tmp_path, "a", rows)
    b, _ = run_of(tmp_path, "b", rows_of(4), "output.format=jsonl")  # JSONL parts are read too
    b_out = read_output(b.path)
    index = ReuseIndex([str(b.path), str(a.path)], a.schema.names, identity_digest(a.run))
    assert index.answer(b_out[0][DIGEST_COLUMN])["text"] == b_out[0]["text"]
    assert set(index.answer(b_out[0][DIGEST_COLUMN])) == {
        "text",
        "finish_reason",
        "prompt_tokens",
        "output_tokens",
        "error",
    }
    assert index.answer("0" * 32) is None
    a_out = read_output(a.path)
    assert a_out[2][DIGEST_COLUMN] is None and a_out[2]["error"]["kind"] == "prompt"
    # a's rows with the same requests as b's: b, listed first, gives them
    assert len(index.digests) == 4 + 3 and index.answer(a_out[3][DIGEST_COLUMN])["text"] == a_out[3]["text"]
    found = int(np.searchsorted(index.digests, np.bytes_(a_out[3][DIGEST_COLUMN].encode())))
    assert index.files[index.file_of[found]][0].path == b.path
    behind = ReuseIndex([str(a.path), str(b.path)], a.schema.names, identity_digest(a.run))
    found = int(np.searchsorted(behind.digests, np.bytes_(a_out[3][DIGEST_COLUMN].encode())))
    assert behind.files[behind.file_of[found]][0].path == a.path
    only_a = ReuseIndex([str(a.path)], a.schema.names, identity_digest(a.run))
    assert len(only_a.digests) == 3  # the error row is not indexed


def test_refusals_name_the_directory_and_what_to_do(tmp_path: Path) -> None:
    old, _ = run_of(tmp_path, "old", rows_of(4))
    # an earlier version's directory: its schema (run.yaml) has no digest column
    record = old.run
    schema = old.schema.remove(old.schema.get_field_index(REUSED_COLUMN))
    schema = schema.remove(schema.get_field_index(DIGEST_COLUMN))
    record["output_schema"]["arrow"] = schema_to_text(schema)
    record["batchinfer"] = "0.9.0"
    old.write_run(record)
    with pytest.raises(ConfigError) as e:
        prepared(tmp_path, "new", f"output.reuse={old.path}")
    msg = str(e.value)
    assert str(old.path) in msg and "0.9.0" in msg and "run it again with this batchinfer" in msg
    assert "drop it from output.reuse" in msg
    with pytest.raises(ConfigError, match="drop it from output.reuse"):
        open_reuse_dir(str(old.path))  # the worker's index refuses it the same way
    with pytest.raises(ConfigError, match="is not a run directory"):
        prepared(tmp_path, "new2", f"output.reuse={tmp_path / 'nothing'}")
    own = prepared(tmp_path, "self")
    with pytest.raises(ConfigError, match="this run's own directory"):
        prepared(tmp_path, "self", f"output.reuse={own.path}")
    # an earlier version's own directory cannot record digests: reusing into it is refused
    with pytest.raises(ConfigError, match="needs a new run directory"):
        run_of(tmp_path, "old", rows_of(4), f"output.reuse={prepared(tmp_path, 'fresh').path}")


def test_schema_holds_the_digest_and_reused_columns(tmp_path: Path) -> None:
    run = prepared(tmp_path, "s")
    assert run.schema.field(DIGEST_COLUMN).type == pa.string() and run.schema.field(REUSED_COLUMN).type == pa.bool_()
