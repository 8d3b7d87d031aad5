"""Faults around a commit, stop signals in awkward places and rows vLLM refuses: every row still
lands in the output exactly once, and nothing committed is rewritten (issue 13)."""

from __future__ import annotations

import errno
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from support.corpus import assert_exactly_once, project, read_output, write_corpus
from support.fake_engine import FakeEngine, prepared
from support.openai_batch import request, run_batch
from support.runs import assert_only_missing_rows_redone, committed_rows, model_overrides, recorded_commits

from batchinfer.config.compose import compose
from batchinfer.engine.vllm_engine import Completion
from batchinfer.engine.worker import ShardWorker, StopFlag, Stopped
from batchinfer.errors import RunDirError
from batchinfer.inputs.read import Shard
from batchinfer.launch.local import run_local
from batchinfer.rundir import store
from batchinfer.rundir.locks import ShardLock
from batchinfer.rundir.schema import error_row, rows_to_table
from batchinfer.rundir.store import RunDir

# ---------------------------------------------------------------- publishing a part (no engine)


def test_a_part_name_taken_meanwhile_is_never_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = prepared(tmp_path, 4)
    run.shard_dir(0).mkdir(parents=True)
    first = run.write_part(0, rows_to_table([error_row(0, "doc-00000", "x", "first")], run.schema))
    before = first.read_bytes()
    # A listing that misses part 0 (a second writer, or NFS's attribute cache) must not overwrite it.
    monkeypatch.setattr(RunDir, "parts", lambda self, index: [])
    second = run.write_part(0, rows_to_table([error_row(1, "doc-00001", "x", "second")], run.schema))
    monkeypatch.undo()
    assert (first.name, second.name) == ("part-000000.parquet", "part-000001.parquet")
    assert first.read_bytes() == before
    assert run.read_shard(0).column("row").to_pylist() == [0, 1]


def test_a_link_that_answers_eexist_after_succeeding_publishes_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = prepared(tmp_path, 4)
    run.shard_dir(0).mkdir(parents=True)
    real_link = os.link

    def retransmitted(src: Any, dst: Any) -> None:  # NFS: the LINK's reply was lost, the retry says EEXIST
        real_link(src, dst)
        raise FileExistsError(errno.EEXIST, "File exists", str(dst))

    monkeypatch.setattr(store.os, "link", retransmitted)
    part = run.write_part(0, rows_to_table([error_row(0, "doc-00000", "x", "m")], run.schema))
    monkeypatch.undo()
    assert part.name == "part-000000.parquet"
    assert sorted(os.listdir(run.shard_dir(0))) == ["part-000000.parquet"]  # no second copy, no temporary


# ---------------------------------------------------------------- failure budget (fake engine)


class FailingEngine(FakeEngine):
    def step(self) -> list[Completion]:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_failures_are_counted_under_the_lock_per_submission(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = prepared(tmp_path, 6)
    shard = Shard(0, 0, 6)
    worker = ShardWorker(run, FailingEngine, StopFlag())
    real_write = worker._write_progress
    held = []

    def write_progress(*args: Any, **kw: Any) -> None:
        try:  # a second writer is refused: the count is written under the shard lock
            with ShardLock(run.shard_dir(0)):
                held.append(False)
        except RunDirError:
            held.append(True)
        real_write(*args, **kw)

    monkeypatch.setattr(worker, "_write_progress", write_progress)
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "100")
    for _ in range(2):
        with pytest.raises(RuntimeError):
            worker.run_shard(shard)
    assert worker.failures == 2
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "200")  # `resume` is a new submission: a new budget
    with pytest.raises(RuntimeError):
        worker.run_shard(shard)
    assert worker.failures == 1
    progress = json.loads(run.progress_path(0).read_text())
    assert progress["failures"] == 3 and progress["failures_by_job"] == {"100": 2, "200": 1}
    assert "illegal memory access" in progress["last_error"]
    assert held and all(held)


# ---------------------------------------------------------------- real engine, in process

ROWS = 160


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path, engine: Any) -> dict[str, Any]:
    """A corpus committed in many parts, and its uninterrupted output."""
    d = tmp_path_factory.mktemp("commit-faults")
    corpus = d / "corpus.jsonl"
    rows = write_corpus(corpus, ROWS, seed=11)
    base = [
        f"input.path={corpus}",
        "input.id_column=id",
        "sampling.max_tokens=8",
        "output.commit_every_rows=16",
        *model_overrides(tiny_model_path),
    ]
    out = read_output(run_local(compose([*base, f"output.dir={d}/clean"]), engine=engine).path)
    assert_exactly_once(out, rows)
    return {"base": base, "rows": rows, "out": out, "dir": d}


def part_rows(run: RunDir) -> list[int]:
    """Rows of the committed parts of shard 0, each as often as it was committed."""
    return [r for p in run.parts(0) for r in store.read_table(p, run.schema)["row"].to_pylist()]


@pytest.mark.engine
@pytest.mark.parametrize("where", ["progress.json write", "folder fsync after the part's rename"])
def test_eio_after_a_part_is_published_never_commits_its_rows_twice(
    clean: dict[str, Any], engine: Any, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    out = clean["dir"] / where.split()[0]
    calls = {"n": 0}
    if where.startswith("progress"):
        real = store.atomic_write

        def flaky(path: Path, data: bytes, fault_prefix: Any = None) -> None:
            if path.name == "progress.json":
                calls["n"] += 1
                if calls["n"] == 3:
                    raise OSError(errno.EIO, "Input/output error", str(path))
            real(path, data, fault_prefix)

        monkeypatch.setattr(store, "atomic_write", flaky)
    else:
        real_fsync = store.fsync_dir

        def flaky_fsync(path: Path) -> None:
            if sys._getframe(1).f_code.co_name == "publish_new":
                calls["n"] += 1
                if calls["n"] == 3:
                    raise OSError(errno.EIO, "Input/output error", str(path))
            real_fsync(path)

        monkeypatch.setattr(store, "fsync_dir", flaky_fsync)
    with pytest.raises(Exception, match="Input/output error"):
        run_local(compose([*clean["base"], f"output.dir={out}"]), engine=engine)
    monkeypatch.undo()
    run = RunDir(out)
    before = committed_rows(out)
    assert len(run.parts(0)) == 3  # the fault landed right after the third part was published
    assert len(part_rows(run)) == len(set(part_rows(run))) == 3 * 16  # each row in one part only
    progress = json.loads(run.progress_path(0).read_text())
    assert progress["failures"] == 1 and "Input/output error" in progress["last_error"]
    assert progress["suspects"] == {}  # the filesystem failed, not the engine: no row is suspect

    with recorded_commits() as redone:
        run = run_local(compose([*clean["base"], f"output.dir={out}"]), engine=engine)
    rows = read_output(run.path)
    assert_exactly_once(rows, clean["rows"])
    assert project(rows) == project(clean["out"])
    assert_only_missing_rows_redone(out, before, redone, ROWS)


@pytest.mark.engine
def test_a_stop_while_prompts_are_prepared_is_acted_on_before_any_request(
    clean: dict[str, Any], engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from batchinfer.rundir.prepare import prepare

    run = prepare(compose([*clean["base"], f"output.dir={clean['dir']}/stop-in-prepare"]))
    stop = StopFlag()
    encoded, added = [], []
    real_encode = engine.encode

    def encode(prompt: Any, kwargs: Any = None) -> list[int]:
        encoded.append(prompt)
        if len(encoded) == 5:
            stop.signum = 12  # USR2 arrives while the shard's prompts are being tokenized
        return real_encode(prompt, kwargs)

    monkeypatch.setattr(engine, "encode", encode)
    monkeypatch.setattr(engine, "add", lambda *a: added.append(a))
    with pytest.raises(Stopped, match="SIGUSR2"):
        ShardWorker(run, lambda: engine, stop).run_shard(run.shards()[0])
    assert len(encoded) == 5 and added == []  # stopped at once: the rest was not prepared, nothing was sent
    assert run.parts(0) == []


@pytest.mark.engine
def test_finished_rows_are_committed_before_requests_are_aborted(
    clean: dict[str, Any], engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from batchinfer.rundir.prepare import prepare

    run = prepare(compose([*clean["base"], f"output.dir={clean['dir']}/abort", "output.commit_every_rows=1000"]))
    stop = StopFlag()
    real_step = engine.step
    finished: list[str] = []

    def step() -> list[Completion]:
        done = real_step()
        finished.extend(c.request_id for c in done)
        if finished:
            stop.signum = 15
        return done

    def dead_abort() -> None:
        raise RuntimeError("engine core is dead: cannot abort")

    monkeypatch.setattr(engine, "step", step)
    monkeypatch.setattr(engine, "abort_all", dead_abort)
    try:
        with pytest.raises(Stopped, match="SIGTERM"):
            ShardWorker(run, lambda: engine, stop).run_shard(run.shards()[0])
    finally:
        monkeypatch.undo()
        real_abort = engine.abort_all
        real_abort()  # leave the shared engine empty for the next test
    table = run.read_shard(0)
    assert 0 < table.num_rows < ROWS and table.num_rows >= len(finished)
    by_row = {r["row"]: r for r in clean["out"]}
    for r in table.to_pylist():
        assert r["text"] == by_row[r["row"]]["text"]


@pytest.mark.engine
def test_rows_vllm_or_the_chat_template_refuse_become_error_rows(
    tmp_path: Path, tiny_model_path: Path, engine: Any
) -> None:
    def chat(text: str, role: str = "user", **body: Any) -> dict[str, Any]:
        return {"model": "x", "messages": [{"role": role, "content": text}], **body}

    lines = (
        request("ok-1", chat("the lazy dog"))
        + request("top-p-0", chat("hello world", top_p=0))
        + request("max-tokens-0", chat("quick brown fox", max_tokens=0))
        + request("bad-role", chat("physics", role="tool"))
        + request("ok-2", chat("hello world"))
    )
    out = run_batch(tmp_path, tiny_model_path, engine, lines)
    assert [o["custom_id"] for o in out] == ["ok-1", "top-p-0", "max-tokens-0", "bad-role", "ok-2"]
    assert out[0]["error"] is None and out[0]["response"]["body"]["choices"][0]["message"]["content"].strip()
    assert out[4]["error"] is None and out[4]["response"]["body"]["choices"][0]["message"]["content"].strip()
    errors = {o["custom_id"]: o["error"] for o in out[1:4]}
    assert errors["top-p-0"]["code"] == "sampling" and "top_p" in errors["top-p-0"]["message"]
    assert errors["max-tokens-0"]["code"] == "sampling" and "max_tokens" in errors["max-tokens-0"]["message"]
    assert errors["bad-role"]["code"] == "chat_template" and "unknown role tool" in errors["bad-role"]["message"]
