"""Commits on the shared engine when a write fails after publishing, a stop arrives while prompts are prepared, requests are aborted, or vLLM refuses a row."""

from __future__ import annotations

import errno
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from support.corpus import assert_exactly_once, project, read_output, write_corpus
from support.openai_batch import request, run_batch
from support.runs import assert_only_missing_rows_redone, committed_rows, model_overrides, recorded_commits

from batchinfer import durable
from batchinfer.config.compose import compose
from batchinfer.engine.stopflag import StopFlag
from batchinfer.engine.vllm_engine import Completion
from batchinfer.engine.worker import ShardWorker
from batchinfer.errors import Stopped
from batchinfer.launch.local import run_local
from batchinfer.rundir import tables
from batchinfer.rundir.store import RunDir

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
        # parts of exactly 16 rows: no 5 s commit of fewer on a slow machine (the default window)
        "output.commit_every_seconds=600",
        *model_overrides(tiny_model_path),
    ]
    out = read_output(run_local(compose([*base, f"output.dir={d}/clean"]), engine=engine).path)
    assert_exactly_once(out, rows)
    return {"base": base, "rows": rows, "out": out, "dir": d}


def part_rows(run: RunDir) -> list[int]:
    """Rows of the committed parts of shard 0, each as often as it was committed."""
    files = run.shard_folder(0).committed_files()
    return [r for p in files for r in tables.read_table(p, run.schema)["row"].to_pylist()]


@pytest.mark.engine
@pytest.mark.parametrize("where", ["progress.json write", "folder fsync after the part's rename"])
def test_eio_after_a_part_is_published_never_commits_its_rows_twice(
    clean: dict[str, Any], engine: Any, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    out = clean["dir"] / where.split()[0]
    calls = {"n": 0}
    if where.startswith("progress"):
        real = durable.atomic_write

        def flaky(path: Path, data: bytes, fault_prefix: Any = None, **kw: Any) -> None:
            if path.name == "progress.json":
                calls["n"] += 1
                if calls["n"] == 3:
                    raise OSError(errno.EIO, "Input/output error", str(path))
            real(path, data, fault_prefix, **kw)

        monkeypatch.setattr(durable, "atomic_write", flaky)
    else:
        real_fsync = durable.fsync_dir

        def flaky_fsync(path: Path) -> None:
            if sys._getframe(1).f_code.co_name == "publish_new":
                calls["n"] += 1
                if calls["n"] == 3:
                    raise OSError(errno.EIO, "Input/output error", str(path))
            real_fsync(path)

        monkeypatch.setattr(durable, "fsync_dir", flaky_fsync)
    with pytest.raises(Exception, match="Input/output error"):
        run_local(compose([*clean["base"], f"output.dir={out}"]), engine=engine)
    monkeypatch.undo()
    run = RunDir(out)
    before = committed_rows(out)
    assert len(run.shard_folder(0).committed_files()) == 3  # the fault landed right after the third part was published
    assert len(part_rows(run)) == len(set(part_rows(run))) == 3 * 16  # each row in one part only
    progress = json.loads(run.shard_folder(0).progress_path.read_text())
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
    encoded: list[int] = []
    added: list[Any] = []
    real_render = engine.render_many

    def render_many(prompts: Any, kwargs: Any = None) -> Any:
        encoded.append(len(prompts))
        stop.signum = 12  # USR2 arrives while the first slice of the shard's prompts is prepared
        return real_render(prompts, kwargs)

    monkeypatch.setattr(engine, "render_many", render_many)
    monkeypatch.setattr(engine, "add", lambda *a: added.append(a))
    with pytest.raises(Stopped, match="SIGUSR2"):
        ShardWorker(run, lambda: engine, stop).run_shard(run.shards()[0])
    # stopped at once: no later slice was prepared, nothing was sent
    assert len(encoded) == 1 and 0 < encoded[0] < ROWS and added == []
    assert run.shard_folder(0).committed_files() == []


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
    table = run.shard_folder(0).read_rows()
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
        + request("bad-role", chat("physics", role="narrator"))
        + request("ok-2", chat("hello world"))
    )
    out = run_batch(tmp_path, tiny_model_path, engine, lines)
    assert [o["custom_id"] for o in out] == ["ok-1", "top-p-0", "max-tokens-0", "bad-role", "ok-2"]
    assert out[0]["error"] is None and out[0]["response"]["body"]["choices"][0]["message"]["content"].strip()
    assert out[4]["error"] is None and out[4]["response"]["body"]["choices"][0]["message"]["content"].strip()
    errors = {o["custom_id"]: o["error"] for o in out[1:4]}
    assert errors["top-p-0"]["code"] == "sampling" and "top_p" in errors["top-p-0"]["message"]
    assert errors["max-tokens-0"]["code"] == "sampling" and "max_tokens" in errors["max-tokens-0"]["message"]
    assert errors["bad-role"]["code"] == "chat_template" and "unknown role narrator" in errors["bad-role"]["message"]
