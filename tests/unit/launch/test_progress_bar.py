"""The shard loop's progress bar: no rows/s or ETA until the first commit, then from the rows
finished after it; and the one line a finished `run` ends with."""

from __future__ import annotations

import io

from batchinfer.launch.shardloop import progress_bar
from batchinfer.rundir.stats import summary_line


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_no_estimate_before_the_first_commit_then_one_from_the_rows_after_it() -> None:
    bar = progress_bar(722, 0, "run", file=io.StringIO(), eta_after_commit=True)
    clock = Clock()
    bar._time = clock
    bar.start_t = clock.now
    clock.now += 14  # the first row of a batch finishes after the prefill of all of it
    bar.update(1)
    assert "1/722 [" in str(bar) and "<?, ?row/s]" in str(bar)  # tqdm alone: 2:48:34 for 721 rows
    clock.now += 10
    bar.update(99)
    bar.committed()
    assert "<?, ?row/s]" in str(bar)
    clock.now += 10
    bar.update(50)  # 50 rows in 10 s since the commit: 572 left at 5 rows/s
    assert "150/722 [" in str(bar) and "<01:54,  5.00row/s]" in str(bar)
    bar.committed()  # later commits keep the first one's start
    clock.now += 10
    bar.update(50)
    assert "200/722 [00:44<01:44,  5.00row/s]" in str(bar)
    bar.close()


def test_without_eta_after_commit_the_bar_is_tqdm_s_own() -> None:
    bar = progress_bar(10, 0, "validate", file=io.StringIO())
    clock = Clock()
    bar._time = clock
    bar.start_t = clock.now
    clock.now += 2
    bar.update(4)
    assert "4/10 [00:02<00:03,  2.00row/s]" in str(bar)
    bar.close()


def test_a_run_ends_with_one_summary_line() -> None:
    stats = {"rows": 722, "errors": {"prompt": 2, "overlong": 1}, "output_tokens": 1868, "seconds": {"generate": 92.0}}
    line = summary_line(stats, "/r/output.parquet", 201.4)
    assert (
        line == "done: 722 rows, 3 error rows, 1,868 output tokens at 20.3 tok/s, 3 min 21 s; output: /r/output.parquet"
    )
    one = {"rows": 1, "errors": {}, "output_tokens": 0, "seconds": {"generate": 0.0}}
    assert (
        summary_line(one, "/r/output.jsonl", 4.26)
        == "done: 1 row, 0 error rows, 0 output tokens, 4.3 s; output: /r/output.jsonl"
    )
