"""A run directory's records cut or changed by something else (plan.json, stats.json): every command
that reads them ends in one line naming the file, what is wrong with it and what to do, exit 2, no
traceback; `resume` never says "nothing to resume" over a stats.json it cannot read."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.corpus import write_corpus
from support.fake_engine import FakeEngine, fake_overrides, keyed

from batchinfer.cli import main
from batchinfer.config.compose import compose
from batchinfer.launch.local import run_shards
from batchinfer.rundir.merge import merge
from batchinfer.rundir.prepare import prepare
from batchinfer.rundir.store import RunDir

COMMANDS = ["status", "merge", "report", "resume", "redo"]
BROKEN = {
    "cut": (b'{"shards": [{"index": 0', "not valid JSON: Expecting ',' delimiter at line 1 column 24"),
    "not text": (b"\xff\xfe{}", "not UTF-8 text (byte 0)"),
}


@pytest.fixture
def finished(tmp_path: Path) -> RunDir:
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 8)
    run = prepare(compose(fake_overrides(tmp_path, corpus, "input.id_column=id")))
    run_shards(run, [0], engine=keyed(FakeEngine(), run))
    merge(run)
    return run


def one_line(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("batchinfer: error:")]
    assert code == 2 and "Traceback" not in err and len(lines) == 1, (argv, err[-3000:])
    return lines[0]


def argv(command: str, run: RunDir) -> list[str]:
    return [command, str(run.path), *(["--where", "output_tokens >= 0"] if command == "redo" else [])]


@pytest.mark.parametrize("how", sorted(BROKEN))
def test_a_corrupt_plan_is_named_with_what_to_do(finished: RunDir, how: str, capsys: pytest.CaptureFixture) -> None:
    data, what = BROKEN[how]
    finished.plan_json.write_bytes(data)
    for command in COMMANDS:
        line = one_line(argv(command, finished), capsys)
        assert f"{finished.plan_json} is {what}" in line, (command, line)
        assert "written once by prepare; restore it from a copy, or start the run again in a new output.dir" in line
    assert finished.plan_json.read_bytes() == data  # nothing rewrote it
    finished.plan_json.write_text('{"rows": 8}')
    line = one_line(["status", str(finished.path)], capsys)
    assert f"{finished.plan_json} is not a shard plan" in line


@pytest.mark.parametrize("how", sorted(BROKEN))
def test_a_corrupt_stats_is_named_and_resume_does_not_call_the_run_complete(
    finished: RunDir, how: str, capsys: pytest.CaptureFixture
) -> None:
    data, what = BROKEN[how]
    finished.stats_json.write_bytes(data)
    output = finished.output_path.read_bytes()
    for command in COMMANDS:
        line = one_line(argv(command, finished), capsys)
        assert f"{finished.stats_json} is {what}" in line, (command, line)
        advice = f"merge writes it again: remove it and output.parquet, then `batchinfer merge {finished.path}`"
        assert advice in line, (command, line)
    assert finished.stats_json.read_bytes() == data and finished.output_path.read_bytes() == output
    finished.stats_json.unlink()  # what the advice says: then merge writes both again
    finished.output_path.unlink()
    assert main(["merge", str(finished.path)]) == 0 and finished.stats() is not None
