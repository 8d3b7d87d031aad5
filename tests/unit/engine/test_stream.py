"""A shard streams to the engine in windows (issue 16): the first request goes out before the shard
is read, duplicates across windows are computed once, every row is written once, and a stop while
a later window is prepared is acted on at once; a request the engine died on alone is not fed
again, refused requests are error rows, and the result cache counts bytes. Fake engine, no vLLM."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.corpus import read_output, write_corpus
from support.fake_engine import FakeEngine, fake_overrides, keyed

from batchinfer.config.compose import compose
from batchinfer.engine import stream
from batchinfer.engine.feed import PREFIX_TOKENS, Feed, work_order
from batchinfer.engine.stopflag import StopFlag
from batchinfer.engine.vllm_engine import Completion
from batchinfer.engine.worker import ShardWorker
from batchinfer.errors import Stopped
from batchinfer.launch.local import run_shards
from batchinfer.requests.request import RequestKey, request_digest
from batchinfer.rundir.merge import merge
from batchinfer.rundir.prepare import prepare
from batchinfer.rundir.store import RunDir

ROWS = 240
WINDOW = 32  # windows of 32 rows (the first: 2 x max_num_seqs = 8), so a 240-row shard has several


class CountingEngine(FakeEngine):
    """A fake engine that records how many prompts were tokenized when each request was added."""

    def __init__(self, per_step: int = 3):
        super().__init__(per_step)
        self.encoded = 0
        self.encoded_at_add: list[int] = []

    def encode(self, prompt: Any, chat_template_kwargs: Any = None) -> list[int]:
        self.encoded += 1
        return super().encode(prompt, chat_template_kwargs)

    def add(self, request_id: str, token_ids: list[int], params: Any) -> None:
        self.encoded_at_add.append(self.encoded)
        super().add(request_id, token_ids, params)


@pytest.fixture(autouse=True)
def small_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stream, "WINDOW_MIN_ROWS", WINDOW)
    monkeypatch.setattr(stream, "WINDOW_SEQS", 1)


def _run(tmp_path: Path, rows: list[dict[str, Any]], *extra: str) -> RunDir:
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return prepare(compose(fake_overrides(tmp_path, corpus, "input.id_column=id", *extra)))


def _lead(eng: FakeEngine) -> int:
    """Rows the helper threads may have made beyond those taken: the slices waiting, the one being
    tokenized and the one being rendered."""
    return (stream.ahead_slices(eng.max_num_seqs) + 2) * stream.slice_rows(eng.max_num_seqs)


def _ids(eng: FakeEngine, text: str) -> list[int]:
    return eng.encode([{"content": text}])


def test_first_request_goes_out_before_the_shard_is_read_and_every_row_is_written_once(tmp_path: Path) -> None:
    rows = write_corpus(tmp_path / "w.jsonl", ROWS)
    run = _run(tmp_path, rows, "output.commit_every_rows=10")
    eng = CountingEngine()
    run_shards(run, [0], engine=keyed(eng, run))
    first = stream.first_window_rows(eng.max_num_seqs)
    assert eng.encoded == ROWS  # each row tokenized once
    # the first window (and at most the helper thread's lead), not the shard, before the first request
    assert first == 8 and first <= eng.encoded_at_add[0] <= first + _lead(eng) < ROWS
    # the engine is fed while later windows are read: requests went out at many points of the reading
    assert len(set(eng.encoded_at_add)) >= ROWS // WINDOW
    # each window is in work order (shared prefixes together, by length): the first window's requests
    first_keys = [RequestKey(tuple(ids), "") for ids in eng.added[:first]]
    assert len(set(first_keys)) == first and first_keys == sorted(first_keys, key=work_order)
    assert first_keys != [RequestKey(tuple(_ids(eng, r["text"])), "") for r in rows[:first]]  # not input order
    merge(run)
    out = read_output(run.path)
    assert [r["row"] for r in out] == list(range(ROWS))
    assert [r["id"] for r in out] == [r["id"] for r in rows]
    assert all(r["text"] == FakeEngine.answer(_ids(eng, x["text"])) for r, x in zip(out, rows, strict=True))


@pytest.mark.parametrize("cache_bytes, computed", [(None, 1), (0, 2)])
def test_identical_prompts_in_different_windows_are_computed_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cache_bytes: Any, computed: int
) -> None:
    """Rows 3 and 200 are windows apart: the second takes the first's result from the result
    cache (with the cache off it is computed again: the cache is what finds it)."""
    rows = write_corpus(tmp_path / "w.jsonl", ROWS)
    rows[3]["text"] = rows[200]["text"] = "same prompt far apart"
    rows[100]["text"] = rows[101]["text"] = "same prompt side by side"
    monkeypatch.setattr(stream, "RESULT_CACHE_BYTES", stream.RESULT_CACHE_BYTES if cache_bytes is None else 0)
    run = _run(tmp_path, rows)
    eng = CountingEngine()
    run_shards(run, [0], engine=keyed(eng, run))
    added = [tuple(ids) for ids in eng.added]
    assert added.count(tuple(_ids(eng, "same prompt far apart"))) == computed
    assert added.count(tuple(_ids(eng, "same prompt side by side"))) == 1  # one window: grouped
    out = read_output(merge(run) and run.path)
    assert [r["row"] for r in out] == list(range(ROWS))
    assert out[3]["text"] == out[200]["text"] == FakeEngine.answer(_ids(eng, "same prompt far apart"))
    assert (out[3]["prompt_tokens"], out[200]["prompt_tokens"]) == (21, 21)


def test_a_stop_while_a_later_window_is_prepared_stops_at_once_and_keeps_committed_rows(tmp_path: Path) -> None:
    rows = write_corpus(tmp_path / "w.jsonl", ROWS)
    run = _run(tmp_path, rows, "output.commit_every_rows=5")
    stop = StopFlag()
    eng = CountingEngine()
    real_encode = eng.encode
    at = 3 * WINDOW + 5  # in the fourth window, long after generation began

    def encode(prompt: Any, kwargs: Any = None) -> list[int]:
        if eng.encoded + 1 == at:
            stop.signum = 12  # USR2 arrives while this window's prompts are tokenized
        return real_encode(prompt, kwargs)

    eng.encode = encode  # type: ignore[method-assign]
    with pytest.raises(Stopped, match="SIGUSR2"):
        ShardWorker(run, lambda: eng, stop).run_shard(run.shards()[0])
    # the slice being tokenized when the signal came is finished, and no later one is started
    assert at <= eng.encoded < at + stream.slice_rows(eng.max_num_seqs)
    committed = run.shard_folder(0).read_rows().column("row").to_pylist()
    assert len(committed) == len(set(committed)) > 0 and not run.shard_folder(0).is_done()
    progress = json.loads(run.shard_folder(0).progress_path.read_text())
    assert progress["rows_done"] == len(committed) and progress["first_request_seconds"] >= 0
    # resume: only what is missing goes to the engine, and again before the shard is read
    second = CountingEngine()
    run_shards(run, [0], engine=keyed(second, run))
    assert second.encoded == ROWS - len(committed)
    assert second.encoded_at_add[0] <= stream.first_window_rows(second.max_num_seqs) + _lead(second)
    out = read_output(merge(run) and run.path)
    assert [r["row"] for r in out] == list(range(ROWS))


def test_todo_slices_skip_committed_rows_a_slice_at_a_time() -> None:
    done = stream.done_rows(np.array([7, 3, 3, 12, 4]))
    assert done.tolist() == [3, 4, 7, 12]
    slices = list(stream.todo_slices(2, 14, done, 4))
    assert slices == [[2, 5, 6, 8, 9], [10, 11, 13]]  # gathered past committed rows
    assert list(stream.todo_slices(3, 5, done, 4)) == []


def test_result_cache_keeps_the_most_recent_results_within_its_budget() -> None:
    cache = stream.ResultCache(budget=3 * stream.ENTRY_BYTES + 10)
    keys = [request_digest([i, i + 1], "") for i in range(4)]
    for i, k in enumerate(keys[:3]):
        cache.put(k, f"r{i}", 1)
    assert cache.get(keys[0]) == "r0"  # used: now the most recent
    cache.put(keys[3], "r3", 1)  # over budget: the least recently used (keys[1]) goes
    assert [cache.get(k) for k in keys] == ["r0", None, "r2", "r3"]
    assert request_digest([1, 2], "") != request_digest([1, 2], '{"seed": 1}')
    assert len(cache) == 3 and PREFIX_TOKENS > 2


def test_a_poison_prompt_far_apart_costs_two_engine_deaths_and_refused_requests_are_error_rows(tmp_path: Path) -> None:
    """The engine dies whenever the poison prompt is in flight and refuses two prompts. Rows 3 and
    200 hold the poison, windows apart: the first death makes the rows in flight suspects, the
    second (row 3 alone, isolated) makes row 3 an engine_crash row and records its request, so row
    200 is an error row at once instead of costing two more deaths. Every other row its own answer."""
    rows = write_corpus(tmp_path / "w.jsonl", ROWS)
    rows[3]["text"] = rows[200]["text"] = "poison prompt"
    rows[10]["text"], rows[150]["text"] = "refused prompt one", "refused prompt two"
    run = _run(tmp_path, rows, "output.commit_every_rows=5")
    engines: list[FakeEngine] = []
    recorded: list[Any] = []  # progress.json's crashed requests after each death
    while not run.shard_folder(0).is_done():
        eng = FakeEngine(refuse=["refused prompt one", "refused prompt two"], poison=["poison prompt"])
        engines.append(eng)
        try:
            ShardWorker(run, lambda e=eng: e, StopFlag()).run_shard(run.shards()[0])
        except RuntimeError as e:
            assert "engine core died" in str(e) and len(engines) < 6
            recorded.append(json.loads(run.shard_folder(0).progress_path.read_text()).get("crashed"))
    assert len(engines) == 3  # two engine deaths, none for row 200
    # after the second, row 3's request is known by its digest, for its duplicates
    assert recorded == [{}, {request_digest(eng.ids("poison prompt"), "").hex(): 3}]
    first, second, third = engines
    assert first.died_with is not None and len(first.died_with) > 1  # a full batch in flight
    assert second.died_with == [second.ids("poison prompt")]  # isolated, it died with the poison alone
    assert third.ids("poison prompt") not in third.added
    out = read_output(merge(run) and run.path)
    assert [r["row"] for r in out] == list(range(ROWS))
    assert out[3]["error"]["kind"] == out[200]["error"]["kind"] == "engine_crash"
    assert "identical to row 3's" in out[200]["error"]["message"] and out[200]["text"] is None
    for i in (10, 150):
        assert out[i]["error"]["kind"] == "engine_refused" and "the fake engine refuses" in out[i]["error"]["message"]
    for r, x in zip(out, rows, strict=True):
        if r["row"] not in (3, 200, 10, 150):
            assert r["error"] is None and r["text"] == FakeEngine.answer(_ids(first, x["text"])), r


def test_result_cache_counts_the_bytes_of_texts_and_reasoning() -> None:
    """A result holds its texts and reasoning texts as Python keeps them: an emoji is 4 bytes."""
    feed = Feed(iter([]), lambda base, c: {}, [], 1)
    wide, thinking = "\N{GRINNING FACE}" * 1000, "thinking " * 500
    feed.finished(RequestKey((1, 2, 3), ""), Completion("r", [wide], "stop", 3, 1000, reasoning=[thinking]))
    assert feed.cache.size >= stream.ENTRY_BYTES + 4 * len(wide) + len(thinking)
    assert stream.result_bytes(Completion("r", ["abc"], "stop", 3, 1)) < stream.result_bytes(
        Completion("r", ["\N{GRINNING FACE}" * 3], "stop", 3, 1)
    )
