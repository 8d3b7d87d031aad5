"""The shard loop's progress bar, as drawn, on a fake clock: drawn and timed from the engine being
ready, no rows/s or ETA until the first commit, then from every row finished since ready; log lines
above it; and the one line a finished `run` ends with."""

from __future__ import annotations

import contextlib
import io
import logging
import re
import sys
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest

from batchinfer.launch.local import bar_aware_logging
from batchinfer.launch.shardloop import progress_bar
from batchinfer.rundir.stats import summary_line


class Clock:
    """A clock the test moves, read by the bar (tqdm's own _time) and nothing else."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def run_bar(total: int = 722, initial: int = 0) -> tuple[Any, Clock, io.StringIO]:
    """The shard loop's bar on a text stream, timed by a fake clock from its creation on."""
    clock = Clock()
    out = io.StringIO()
    with mock.patch("tqdm.std.time", clock):  # tqdm's clock (its _time) is looked up at creation
        bar = progress_bar(total, initial, "run", file=out, eta_after_commit=True)
    assert bar._time is clock
    return bar, clock, out


def last_line(out: io.StringIO) -> str:
    """The bar as last drawn (tqdm redraws its line after a carriage return or a newline)."""
    return re.split(r"[\r\n]", out.getvalue().rstrip("\n"))[-1]


def test_the_bar_is_drawn_and_timed_from_the_engine_being_ready() -> None:
    bar, clock, out = run_bar()
    clock.now += 99.5  # the engine starts; log lines redraw bars meanwhile
    bar.refresh()
    assert out.getvalue() == ""  # nothing drawn while the engine starts (it showed 0/722 [01:39<?)
    bar.ready()
    assert last_line(out) == "run:   0%|          | 0/722 [00:00<?, ?row/s]"
    clock.now += 30
    bar.ready()  # a later shard's start: the clock runs on (it restarted at 00:00 before)
    bar.update(1)
    bar.refresh()
    assert last_line(out).endswith("1/722 [00:30<?, ?row/s]")
    bar.close()


def test_no_estimate_before_the_first_commit_then_one_from_every_row_since_ready() -> None:
    bar, clock, out = run_bar()
    bar.ready()
    clock.now += 14  # the first row of a batch finishes after the prefill of all of it
    bar.update(1)
    bar.refresh()
    assert last_line(out).endswith("1/722 [00:14<?, ?row/s]")  # tqdm alone: 2:48:34 for 721 rows
    clock.now += 48
    bar.update(523)
    bar.committed()
    clock.now += 1  # then one row a second after the commit, as batches end in bursts
    bar.update(1)
    bar.refresh()
    # 525 rows in 63 s: 8.33 rows/s, 197 left in 24 s (it said 6.99 s/row and 22:56 here)
    assert last_line(out).endswith("525/722 [01:03<00:23,  8.33row/s]")
    clock.now += 14
    bar.update(197)
    bar.close()
    assert last_line(out).endswith("722/722 [01:17<00:00,  9.38row/s]")


def test_a_resumed_run_counts_only_the_rows_done_here() -> None:
    bar, clock, out = run_bar(total=1000, initial=600)
    bar.count_done(100)  # a shard handed to this engine later, 100 of its rows committed before
    bar.ready()
    clock.now += 10
    bar.committed()
    bar.update(50)
    bar.refresh()
    assert last_line(out).endswith("750/1000 [00:10<00:50,  5.00row/s]")
    bar.close()


def test_a_bar_never_drawn_leaves_nothing() -> None:
    bar, clock, out = run_bar()
    clock.now += 5
    bar.close()  # the engine failed to start
    assert out.getvalue() == ""


@contextlib.contextmanager
def console_bar(total: int, desc: str) -> Iterator[tuple[Any, Clock, logging.Logger]]:
    """The shard loop's bar on stderr beside batchinfer's console log handler, on a fake clock."""
    logger = logging.getLogger("batchinfer")
    handler = logging.StreamHandler(sys.stderr)  # the console handler the CLI sets up
    logger.addHandler(handler)
    try:
        with bar_aware_logging():
            clock = Clock()
            with mock.patch("tqdm.std.time", clock):
                bar = progress_bar(total, 0, desc, file=sys.stderr, eta_after_commit=True)
            yield bar, clock, logger
    finally:
        logger.removeHandler(handler)


def test_log_lines_are_written_above_the_bar_not_onto_it(capsys: pytest.CaptureFixture[str]) -> None:
    with console_bar(722, "run") as (bar, clock, logger):
        logger.warning("starting vLLM engine")  # before the bar is drawn: nothing of it around
        bar.ready()
        bar.update(3)
        logger.warning("shard 0: a line while the bar is drawn")
        clock.now += 1
        bar.refresh()
        bar.close()
    err = capsys.readouterr().err
    assert err.startswith("starting vLLM engine\n"), repr(err)
    lines = re.split(r"[\r\n]", err)
    assert "shard 0: a line while the bar is drawn" in lines  # a line of its own, not after the bar
    # captured stderr is no terminal: the bar's last line is the one drawn after the log line
    assert re.split(r"[\r\n]", err.rstrip("\n"))[-1].endswith("3/722 [00:00<?, ?row/s]")


class Terminal(io.StringIO):
    """A text stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def test_not_on_a_terminal_the_bar_writes_plain_lines_and_log_lines_stay_whole(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A Slurm log or `> log 2>&1`: one line per bar state (about every 5 s), no carriage-return
    redraw; a log line on a line of its own, the bar not drawn again for it without progress."""
    with console_bar(40, "s1") as (bar, clock, logger):
        bar.ready()
        logger.warning("shard 0: first request")
        clock.now += 1
        bar.update(5)  # within mininterval: no line
        clock.now += 5
        bar.committed()
        bar.update(15)
        logger.warning("shard 0: committed 20 rows")
        clock.now += 6
        bar.update(20)
        bar.close()
    err = capsys.readouterr().err
    assert "\r" not in err, repr(err)
    assert err.splitlines() == [
        "s1:   0%|          | 0/40 [00:00<?, ?row/s]",
        "shard 0: first request",
        "s1:  50%|#####     | 20/40 [00:06<00:06,  3.33row/s]",
        "shard 0: committed 20 rows",
        "s1: 100%|##########| 40/40 [00:12<00:00,  3.33row/s]",
    ]


def test_on_a_terminal_the_bar_redraws_its_line() -> None:
    out = Terminal()
    bar = progress_bar(10, 0, "run", file=out)
    bar.update(10)
    bar.close()
    assert "\r" in out.getvalue() and not bar.plain


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
