"""prepare never clears a folder batchinfer did not make: a non-empty output.dir without run.yaml
is refused naming what is there, and nothing in it changes (issue 26); a prepare killed half way
is redone in the folder it made."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from support.corpus import write_corpus
from support.procs import run_cli
from support.runs import fake_model_dir

from batchinfer.config.compose import compose
from batchinfer.errors import ConfigError, FolderRefused
from batchinfer.rundir.prepare import PREPARING, prepare


def tree(d: Path) -> dict[str, str]:
    """Every file under d and a digest of its bytes."""
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in d.rglob("*") if p.is_file()}


def overrides(tmp_path: Path, corpus: Path, out: Path) -> list[str]:
    return [f"input.path={corpus}", f"model.path={fake_model_dir(tmp_path)}", f"output.dir={out}"]


def test_a_project_folder_holding_the_corpus_is_refused_and_left_alone(tmp_path: Path) -> None:
    proj = tmp_path / "proj"
    (proj / "input").mkdir(parents=True)
    corpus = proj / "input" / "corpus.jsonl"
    write_corpus(corpus, 5)
    (proj / "notes.txt").write_text("mine")
    before = tree(proj)
    with pytest.raises(FolderRefused, match=r"output.dir .*proj is not empty and batchinfer did not make it") as e:
        prepare(compose(overrides(tmp_path, corpus, proj)))
    assert "it holds input, notes.txt" in str(e.value) and "never writes into or clears a folder" in str(e.value)
    assert tree(proj) == before
    # the command says so and stops with the config-error code, before any engine
    res = run_cli(["run", *overrides(tmp_path, corpus, proj)])
    assert res.returncode == 2 and "batchinfer did not make it" in res.stderr, res.stderr[-2000:]
    assert tree(proj) == before


def test_an_empty_folder_or_a_new_one_is_prepared(tmp_path: Path) -> None:
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 5)
    empty = tmp_path / "empty"
    empty.mkdir()
    for out in (empty, tmp_path / "new" / "run"):
        run = prepare(compose(overrides(tmp_path, corpus, out)))
        assert run.exists() and not (out / PREPARING).exists()
        assert prepare(compose(overrides(tmp_path, corpus, out))).path == run.path  # reopened, not refused


def test_a_prepare_killed_half_way_is_redone_in_its_own_folder(tmp_path: Path) -> None:
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 5)
    out = tmp_path / "run"
    (out / "input").mkdir(parents=True)
    (out / PREPARING).touch()  # what a prepare SIGKILLed while converting the input leaves
    (out / "input" / "data-00000-of-00001.arrow").write_bytes(b"torn")
    run = prepare(compose(overrides(tmp_path, corpus, out)))
    assert run.exists() and not (out / PREPARING).exists()
    assert not (out / "input" / "data-00000-of-00001.arrow").read_bytes().startswith(b"torn")


def test_an_output_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 5)
    (tmp_path / "out").write_text("x")
    with pytest.raises(FolderRefused, match="is a file, not a folder"):
        prepare(compose(overrides(tmp_path, corpus, tmp_path / "out")))
    assert (tmp_path / "out").read_text() == "x"


def test_a_misspelt_sampling_column_is_refused_before_the_run_directory_is_kept(tmp_path: Path) -> None:
    """run/submit refuse it as validate does: a misspelt column would run every row with the
    config's sampling, silently (issue 26)."""
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 5)
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"input.sampling_column='txt' is not a column of .*did you mean"):
        prepare(compose([*overrides(tmp_path, corpus, out), "input.sampling_column=txt"]))
    assert not out.exists()  # refused before the run directory was made, or it was removed
