"""What a failure costs the rows in flight (issue 27): only the engine's own failures make them
suspects; a refused isolated request ends isolation like a finished one; a stop already pending
starts no engine; a result for a request of an earlier attempt on a reused engine is not taken for
this attempt's. Fake engine, no vLLM."""

from __future__ import annotations

import errno
import json
import signal
from pathlib import Path
from typing import Any

import pytest
from support.corpus import read_output, write_corpus
from support.fake_engine import FakeEngine, fake_overrides, keyed

from batchinfer.config.compose import compose
from batchinfer.engine.stopflag import StopFlag
from batchinfer.engine.vllm_engine import Completion
from batchinfer.engine.worker import ShardWorker
from batchinfer.errors import Stopped
from batchinfer.inputs.convert import open_input
from batchinfer.launch.local import run_shards
from batchinfer.rundir.merge import merge
from batchinfer.rundir.prepare import prepare
from batchinfer.rundir.store import RunDir

ROWS = 40


def _run(tmp_path: Path, n: int = ROWS, *extra: str) -> tuple[RunDir, list[dict[str, Any]]]:
    corpus = tmp_path / "c.jsonl"
    rows = write_corpus(corpus, n)
    run = prepare(compose(fake_overrides(tmp_path, corpus, "input.id_column=id", *extra)))
    return run, rows


def _progress(run: RunDir) -> dict[str, Any]:
    return json.loads(run.shard_folder(0).progress_path.read_text())


def _assert_own_answers(run: RunDir, rows: list[dict[str, Any]], errors: dict[int, str]) -> None:
    """The merged output: every row once, in order; the rows `errors` names are error rows of that
    kind, every other row the answer to its own prompt."""
    out = read_output(merge(run) and run.path)
    assert [r["row"] for r in out] == list(range(len(rows)))
    eng = FakeEngine()
    for r, x in zip(out, rows, strict=True):
        if r["row"] in errors:
            assert r["error"]["kind"] == errors[r["row"]], r
        else:
            assert r["error"] is None and r["text"] == FakeEngine.answer(eng.ids(x["text"])), r


class FailingInput:
    """The memory-mapped input, whose `fail_at`-th read fails with EIO (a flaky file system)."""

    def __init__(self, real: Any, fail_at: int):
        self.real = real
        self.fail_at = fail_at
        self.reads = 0

    def select(self, indices: list[int]) -> Any:
        self.reads += 1
        if self.reads == self.fail_at:
            raise OSError(errno.EIO, "Input/output error", "input/data-00000-of-00001.arrow")
        return self.real.select(indices)


def _fail_reading(worker: ShardWorker, run: RunDir) -> None:
    worker._dataset = FailingInput(open_input(run.input_dir), fail_at=4)  # rows are in flight by then


def _fail_making_a_row(worker: ShardWorker, run: RunDir) -> None:
    real = worker.task_rows.result_row
    made = [0]

    def result_row(base: dict[str, Any], c: Completion) -> dict[str, Any]:
        made[0] += 1
        if made[0] == 7:
            raise KeyError("a bug in making a result row")
        return real(base, c)

    worker.task_rows.result_row = result_row  # type: ignore[method-assign]


@pytest.mark.parametrize(
    "fail, error",
    [(_fail_reading, "OSError: [Errno 5] Input/output error"), (_fail_making_a_row, "a bug in making a result row")],
    ids=["input-EIO", "bug"],
)
def test_a_failure_outside_the_engine_makes_no_row_suspect(tmp_path: Path, fail: Any, error: str) -> None:
    """Twice in a row (the attempts that would make a suspect row an engine_crash error row), a
    failure that is not the engine's, with rows in flight: no row is suspect, and the third attempt
    answers every row from the engine."""
    run, rows = _run(tmp_path, ROWS, "output.commit_every_rows=1000")
    for attempt in (1, 2):
        eng = keyed(FakeEngine(per_step=1), run)
        worker = ShardWorker(run, lambda e=eng: e, StopFlag())
        fail(worker, run)
        with pytest.raises((OSError, KeyError)):
            worker.run_shard(run.shards()[0])
        assert eng.aborted, "the failure came with requests in flight"
        progress = _progress(run)
        assert progress["suspects"] == {} and progress["failures"] == attempt and error in progress["last_error"]
    run_shards(run, [0], engine=keyed(FakeEngine(), run))
    _assert_own_answers(run, rows, errors={})


def test_an_engine_failure_makes_the_rows_in_flight_suspects(tmp_path: Path) -> None:
    """The other side: a failure of the engine's step counts against exactly the rows in flight."""
    run, rows = _run(tmp_path, ROWS)
    eng = keyed(FakeEngine(poison=[rows[5]["text"]]), run)
    with pytest.raises(RuntimeError, match="engine core died"):
        ShardWorker(run, lambda: eng, StopFlag()).run_shard(run.shards()[0])
    assert eng.died_with is not None
    in_flight = {i for i, r in enumerate(rows) if eng.ids(r["text"]) in eng.died_with}
    assert 5 in in_flight and len(in_flight) > 1
    assert _progress(run)["suspects"] == {str(i): 1 for i in sorted(in_flight)}


def test_a_refused_isolated_request_ends_isolation_like_a_finished_one(tmp_path: Path) -> None:
    """Rows 2 and 5 were in flight at an engine death: they run one at a time first; row 5 is
    refused. Then the shard streams with many requests in flight: the refusal does not keep one
    more request running alone."""
    run, rows = _run(tmp_path, ROWS)
    run.shard_folder(0).progress_path.parent.mkdir(parents=True, exist_ok=True)
    run.shard_folder(0).progress_path.write_text(json.dumps({"shard": 0, "suspects": {"2": 1, "5": 1}}))
    eng = keyed(FakeEngine(refuse=[rows[5]["text"]]), run)
    ShardWorker(run, lambda: eng, StopFlag()).run_shard(run.shards()[0])
    assert eng.added[0] == eng.ids(rows[2]["text"]) and eng.in_flight[0] == 1  # row 2 alone first
    assert eng.in_flight[1] > 1  # then no request runs alone in its place (row 5's turn was refused)
    assert max(eng.in_flight) == 2 * eng.max_num_seqs
    _assert_own_answers(run, rows, errors={5: "engine_refused"})


def test_a_stop_pending_before_the_engine_starts_starts_no_engine(tmp_path: Path) -> None:
    run, _ = _run(tmp_path, ROWS)
    stop = StopFlag()
    stop._handle(signal.SIGUSR2, None)  # arrived while the shard's committed parts were read
    started: list[FakeEngine] = []
    with pytest.raises(Stopped, match="SIGUSR2"):
        ShardWorker(run, lambda: started.append(FakeEngine()) or started[-1], stop).run_shard(run.shards()[0])
    assert started == [] and run.shard_folder(0).read_rows().num_rows == 0 and not run.shard_folder(0).is_done()


class StaleEngine(FakeEngine):
    """A reused engine whose abort does not take back requests already sent: it still answers them
    (as an engine may return an output that was on its way when the requests were aborted)."""

    def abort_all(self) -> None:
        pass


def test_a_result_for_an_earlier_attempts_request_on_a_reused_engine_is_ignored(tmp_path: Path) -> None:
    """Attempt 1 stops after one step with requests in flight; attempt 2 on the same engine gets
    their answers among its own. Each row is still its own prompt's answer, written once."""
    run, rows = _run(tmp_path, ROWS, "output.commit_every_rows=1000")
    stop = StopFlag()
    eng = keyed(StaleEngine(), run)
    real_step = eng.step

    def step_then_stop() -> list[Completion]:
        stop.signum = signal.SIGTERM
        return real_step()

    eng.step = step_then_stop  # type: ignore[method-assign]
    with pytest.raises(Stopped):
        ShardWorker(run, lambda: eng, stop).run_shard(run.shards()[0])
    assert eng.queue and run.shard_folder(0).read_rows().num_rows == eng.per_step  # the rest still in the engine
    eng.step = real_step  # type: ignore[method-assign]
    ShardWorker(run, lambda: eng, StopFlag()).run_shard(run.shards()[0])
    _assert_own_answers(run, rows, errors={})
