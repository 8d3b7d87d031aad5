"""A folder holding a run.yaml batchinfer did not write (another tool's, an older format, not YAML):
every command that reads it ends in one line naming the file and what it is instead, exit 2, no
traceback (issue 40)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.corpus import write_corpus
from support.runs import fake_model_dir

from batchinfer.cli import main

FOREIGN = {
    "another tool's": (
        "apiVersion: batch/v1\nkind: Job\nspec: {}\n",
        "it has no `batchinfer` version (its keys: apiVersion, kind, spec)",
    ),
    "a list": ("- step: train\n- step: eval\n", "it holds a YAML list, not a mapping"),
    "not YAML": ("key: [unclosed\n", "it is not YAML"),
    "an older format": (
        "batchinfer: 0.1.0\nconfig:\n  output:\n    lock: 3\ninput: {}\n",
        "was written by batchinfer 0.1.0 in a format this version cannot read (no fingerprint_keys, output_schema)",
    ),
    "a config that is text": ("batchinfer: 0.1.0\nconfig: text\n", "in a format this version cannot read (no config,"),
}


def commands(tmp_path: Path, d: Path) -> dict[str, list[str]]:
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 4)
    model = f"model.path={fake_model_dir(tmp_path)}"
    return {
        "status": ["status", str(d)],
        "merge": ["merge", str(d)],
        "report": ["report", str(d)],
        "resume": ["resume", str(d)],
        "redo": ["redo", str(d), "--where", "finish_reason == 'length'"],
        "output.dir": ["run", f"input.path={corpus}", model, f"output.dir={d}"],
        "output.reuse": ["run", f"input.path={corpus}", model, f"output.dir={tmp_path / 'new'}", f"output.reuse={d}"],
    }


@pytest.mark.parametrize("kind", sorted(FOREIGN))
def test_every_command_names_the_file_in_one_line(tmp_path: Path, kind: str, capsys: pytest.CaptureFixture) -> None:
    text, what = FOREIGN[kind]
    d = tmp_path / "theirs"
    d.mkdir()
    (d / "run.yaml").write_text(text)
    (d / "notes.txt").write_text("theirs")
    for name, argv in commands(tmp_path, d).items():
        code = main(argv)
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("batchinfer: error:")]
        assert code == 2 and "Traceback" not in err and len(lines) == 1, (name, err[-3000:])
        assert f"{d / 'run.yaml'}" in lines[0] and what in lines[0], (name, lines[0])
    assert sorted(p.name for p in d.iterdir()) == ["notes.txt", "run.yaml"] and (d / "run.yaml").read_text() == text
    assert not (tmp_path / "new").exists()
