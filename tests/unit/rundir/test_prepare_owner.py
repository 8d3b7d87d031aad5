"""Two prepares of one output.dir (two `submit`s or `run`s a second apart), for real: the second is
refused naming the first while the first makes the folder, neither touches what the other made,
and a prepare killed half way is adopted by the next (issue 40). The first process stops inside
its input conversion (a blocked hook) until told to go on, fail, or is killed."""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from support.corpus import write_corpus
from support.procs import python_child
from support.runs import fake_model_dir

from batchinfer.config.compose import compose
from batchinfer.durable import read_json
from batchinfer.errors import FolderRefused, RunDirError
from batchinfer.ownership import Kind, recognise
from batchinfer.rundir.prepare import PREPARING, prepare

FIRST = """
import json, sys
from batchinfer.config.compose import compose
from batchinfer.rundir import prepare as prep

real = prep._convert

def blocked(run, inp):
    print("converting", flush=True)
    if sys.stdin.readline().strip() == "fail":
        raise ValueError("the first prepare's input is bad")
    return real(run, inp)

prep._convert = blocked
run = prep.prepare(compose(json.loads(sys.argv[1])))
print("prepared", run.path, flush=True)
"""


def overrides(tmp_path: Path, corpus: Path, out: Path) -> list[str]:
    return [f"input.path={corpus}", f"model.path={fake_model_dir(tmp_path)}", f"output.dir={out}"]


@contextmanager
def first_prepare(tmp_path: Path, corpus: Path, out: Path) -> Iterator[subprocess.Popen]:
    """A prepare in another process, stopped inside its input conversion."""
    proc = python_child(FIRST, json.dumps(overrides(tmp_path, corpus, out)))
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "converting", proc.communicate()[1][-3000:]
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def tree(d: Path) -> dict[str, int]:
    return {str(p.relative_to(d)): p.stat().st_ino for p in d.rglob("*") if not p.name.startswith(".batchinfer")}


@pytest.fixture
def corpora(tmp_path: Path) -> tuple[Path, Path]:
    big, small = tmp_path / "big.jsonl", tmp_path / "small.jsonl"
    write_corpus(big, 60)
    write_corpus(small, 30)
    return big, small


def test_a_second_prepare_is_refused_and_the_first_ones_failure_removes_only_its_own(
    tmp_path: Path, corpora: tuple[Path, Path]
) -> None:
    big, small = corpora
    out = tmp_path / "run"
    with first_prepare(tmp_path, big, out) as first:
        before = tree(out)
        with pytest.raises(FolderRefused) as e:
            prepare(compose(overrides(tmp_path, small, out)))
        assert str(e.value).startswith(f"output.dir {out} is being made by batchinfer prepare (host ")
        assert f" pid {first.pid}, since " in str(e.value) and "\n" not in str(e.value)
        assert tree(out) == before  # nothing of the first one's touched
        _, err = first.communicate("fail\n", timeout=120)
        assert first.returncode == 1 and "the first prepare's input is bad" in err
    assert not out.exists()  # the first one made it and failed: gone whole
    run = prepare(compose(overrides(tmp_path, small, out)))  # the folder is free again
    assert read_json(run.plan_json)["rows"] == 30


def test_the_first_prepare_wins_and_the_second_is_refused_naming_it(tmp_path: Path, corpora: tuple[Path, Path]) -> None:
    """The reported loss: one printed 60 rows while the folder held the other's 30-row plan."""
    big, small = corpora
    out = tmp_path / "run"
    with first_prepare(tmp_path, big, out) as first:
        with pytest.raises(FolderRefused, match=f"pid {first.pid}"):
            prepare(compose(overrides(tmp_path, small, out)))
        said, err = first.communicate("\n", timeout=120)
        assert first.returncode == 0 and said.strip() == f"prepared {out}", err
    assert read_json(out / "plan.json")["rows"] == 60
    with pytest.raises(RunDirError, match=r"\(made by batchinfer prepare \(host .* pid \d+.*different config"):
        prepare(compose(overrides(tmp_path, small, out)))
    assert read_json(out / "plan.json")["rows"] == 60
    again = prepare(compose(overrides(tmp_path, big, out)))  # the same command: one result, reopened
    assert again.path == out and read_json(again.plan_json)["rows"] == 60


def test_a_prepare_killed_half_way_is_adopted_by_the_next(tmp_path: Path, corpora: tuple[Path, Path]) -> None:
    big, small = corpora
    out = tmp_path / "run"
    with first_prepare(tmp_path, big, out) as first:
        first.send_signal(signal.SIGKILL)
        first.wait()
    found = recognise(out)
    assert found.kind is Kind.HALF_MADE and found.mark is not None and found.mark.maker.pid == first.pid
    run = prepare(compose(overrides(tmp_path, small, out)))
    assert read_json(run.plan_json)["rows"] == 30 and recognise(out).kind is Kind.DONE


def test_nothing_is_written_into_a_users_folder_not_even_a_probe(tmp_path: Path, corpora: tuple[Path, Path]) -> None:
    """The folder's mtime changes with any file made and removed in it (a write probe, a lock)."""
    big, _ = corpora
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years")
    stamp = mine.stat().st_mtime_ns
    with pytest.raises(FolderRefused, match="batchinfer did not make it"):
        prepare(compose(overrides(tmp_path, big, mine)))
    assert mine.stat().st_mtime_ns == stamp and [p.name for p in mine.iterdir()] == ["thesis.tex"]


def test_a_killed_prepares_folder_holding_a_users_file_is_refused_naming_it(
    tmp_path: Path, corpora: tuple[Path, Path]
) -> None:
    """The reported loss: a prepare SIGKILLed half way, then the user puts a file into its folder;
    the next prepare took the folder over and removed that file without a word."""
    big, small = corpora
    out = tmp_path / "run"
    with first_prepare(tmp_path, big, out) as first:
        first.send_signal(signal.SIGKILL)
        first.wait()
    (out / "my-notes.txt").write_text("precious")
    before = tree(out)
    with pytest.raises(FolderRefused) as e:
        prepare(compose(overrides(tmp_path, small, out)))
    message = str(e.value)
    assert message.startswith(f"output.dir {out} was left half made by batchinfer prepare (host ")
    assert f"pid {first.pid}" in message and "it holds my-notes.txt" in message and "\n" not in message
    assert tree(out) == before and (out / "my-notes.txt").read_text() == "precious"
    (out / "my-notes.txt").rename(tmp_path / "my-notes.txt")  # moved away, as the refusal says
    run = prepare(compose(overrides(tmp_path, small, out)))
    assert read_json(run.plan_json)["rows"] == 30 and recognise(out).kind is Kind.DONE


def test_an_older_versions_marker_does_not_make_a_users_folder_its_own(
    tmp_path: Path, corpora: tuple[Path, Path]
) -> None:
    """The reported loss: `.batchinfer-preparing` (what an older prepare wrote first) in a user's
    folder made it "half made by an older batchinfer", and a failing prepare then emptied it."""
    big, _ = corpora
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / PREPARING).touch()
    (mine / "thesis.tex").write_text("years")
    bad = [*overrides(tmp_path, big, mine), "input.id_column=nosuchcol"]  # a prepare that fails in _create
    with pytest.raises(FolderRefused, match=r"is not empty and batchinfer did not make it \(it holds thesis.tex\)"):
        prepare(compose(bad))
    assert sorted(p.name for p in mine.iterdir()) == [PREPARING, "thesis.tex"]
    assert (mine / "thesis.tex").read_text() == "years"
