"""One row, one verdict (issue 41): a table of hostile values, each run through `batchinfer validate`
and through the worker on one corpus; validate must report exactly the rows the run makes error rows,
of the same kind. The stand-in engine runs the worker where it raises what vLLM raises; the real
engine (the session's shared one) where only vLLM's own behaviour proves it.

To add a case: a row of ROW_CASES (the row's own sampling values, through input.sampling_column),
of OPENAI_CASES (an OpenAI Batch request body), or a test of its own that builds a corpus and calls
`verdicts` (file-level problems: compare validate's stop with the run's refusal)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple, Optional

import pytest
from support.openai_batch import request
from support.runs import committed_rows, run_overrides
from support.standin import StandinEngine

from batchinfer.config.compose import compose
from batchinfer.insight import findings
from batchinfer.insight.validate import validate
from batchinfer.insight.validate_report import format_report
from batchinfer.launch.local import run_local

SECRET = "the private file's content must not reach any output"


class Case(NamedTuple):
    """A hostile row: its own sampling values and the error kind it must make (None: it runs)."""

    name: str
    params: Any
    kind: Optional[str]


ROW_CASES = [
    Case("fine", {"max_tokens": 3}, None),
    Case("logprobs above the cap (VLLMValidationError at add)", {"logprobs": 50}, "sampling"),
    Case("structured_outputs not an object", {"structured_outputs": "junk"}, "sampling"),
    Case("structured_outputs.json a path in row data", {"structured_outputs": {"json": "@SECRET@"}}, "sampling"),
    Case("min_tokens above max_tokens", {"min_tokens": 9, "max_tokens": 4}, "sampling"),
    Case("an empty stop string", {"stop": [""]}, "sampling"),
    Case("seed at 2^63", {"seed": 2**63, "temperature": 0.5}, "sampling"),
    Case("temperature above 2", {"temperature": 3.0}, "sampling"),
    Case("n > 1 with greedy sampling", {"n": 2}, "sampling"),
    Case("a regex vLLM's grammar refuses", {"structured_outputs": {"regex": "(?=a)a"}}, "sampling"),
    Case("a regex that does not compile", {"structured_outputs": {"regex": "("}}, "sampling"),
    Case("two constraints", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "sampling"),
    Case("an empty choice", {"structured_outputs": {"choice": []}}, "sampling"),
    Case("top_k above the vocabulary", {"top_k": 100_000, "temperature": 0.5}, "sampling"),
    Case("an unknown sampling key", {"best_of": 2}, "sampling"),
    Case("a fine choice", {"structured_outputs": {"choice": ["yes", "no"]}}, None),
]

OPENAI_CASES = [
    Case("fine", {"max_tokens": 3}, None),
    Case("min_tokens above max_tokens", {"min_tokens": 9, "max_tokens": 4}, "sampling"),
    Case("logprobs above the cap", {"logprobs": True, "top_logprobs": 50}, "unsupported"),
    Case("an empty stop string", {"stop": [""]}, "sampling"),
]


def _row_corpus(path: Path, cases: Sequence[Case], secret: Path) -> Path:
    with path.open("w") as f:
        for i, case in enumerate(cases):
            params = json.loads(json.dumps(case.params).replace("@SECRET@", str(secret)))
            f.write(json.dumps({"id": f"r{i}", "text": f"hello world {i}", "params": params}) + "\n")
    return path


def _openai_corpus(path: Path, cases: Sequence[Case]) -> Path:
    messages = [{"role": "user", "content": "hello world"}]
    path.write_text("".join(request(f"r{i}", dict(c.params, messages=messages)) for i, c in enumerate(cases)))
    return path


@pytest.fixture(autouse=True)
def every_example(monkeypatch: pytest.MonkeyPatch) -> None:
    """validate's report keeps every problem as an example, so it names each row."""
    monkeypatch.setattr(findings, "EXAMPLES", 1000)


def verdicts(overrides: list[str], engine: Any) -> tuple[dict[int, str], dict[int, str]]:
    """(row -> error kind) as `validate` reports it, and as the run writes it on engine."""
    report = validate(compose(overrides), jobs=1, progress=False)
    assert report["stops"]["count"] == 0, report["stops"]
    predicted = {}
    for kind, entry in report["error_rows"]["by_kind"].items():
        assert entry["count"] == len(entry["examples"]), "more rows of a kind than the report's examples"
        predicted.update({ex["row"]: kind for ex in entry["examples"]})
    run = run_local(compose(overrides), engine=engine)
    rows = committed_rows(run.path)
    for shard in run.shards():  # the shard went on: no row was charged as an engine suspect
        progress = json.loads((run.shard_folder(shard.index).path / "progress.json").read_text())
        assert not progress.get("suspects"), progress
    made = {}
    for row, r in rows.items():
        r = json.loads(r) if isinstance(r, bytes) else r
        if r.get("error"):
            made[row] = r["error"]["kind"]
    return predicted, made


def _expected(cases: Sequence[Case]) -> dict[int, str]:
    return {i: c.kind for i, c in enumerate(cases) if c.kind}


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    """A private JSON file a row names as its schema: it must never be read on the compute node."""
    path = tmp_path / "private.json"
    path.write_text(json.dumps({"type": "string", "enum": [SECRET]}))
    path.chmod(0o600)
    return path


def test_rows_validate_and_the_standin_worker_agree(tmp_path: Path, tiny_model_path: Path, secret: Path) -> None:
    """Each hostile row is the same error row in validate and in the run, and the shard finishes."""
    corpus = _row_corpus(tmp_path / "rows.jsonl", ROW_CASES, secret)
    ov = run_overrides(tiny_model_path, corpus, tmp_path / "run", "input.sampling_column=params")
    predicted, made = verdicts(ov, StandinEngine(compose(ov)))
    assert predicted == made == _expected(ROW_CASES), [c.name for c in ROW_CASES]


def test_openai_lines_validate_and_the_standin_worker_agree(tmp_path: Path, tiny_model_path: Path) -> None:
    """An OpenAI line vLLM would refuse (min_tokens above max_tokens) is the same error row in both."""
    corpus = _openai_corpus(tmp_path / "batch.jsonl", OPENAI_CASES)
    ov = run_overrides(tiny_model_path, corpus, tmp_path / "run")
    ov.remove("input.id_column=id")
    predicted, made = verdicts(ov, StandinEngine(compose(ov)))
    assert predicted == made == _expected(OPENAI_CASES), [c.name for c in OPENAI_CASES]


def test_rows_validate_and_the_real_engine_agree(
    tmp_path: Path, tiny_model_path: Path, engine: Any, secret: Path
) -> None:
    """The same corpus on vLLM itself: the same error rows, the shard goes on, the rows that run have
    answers, and the private file named in a row's data is in no output."""
    corpus = _row_corpus(tmp_path / "rows.jsonl", ROW_CASES, secret)
    ov = run_overrides(tiny_model_path, corpus, tmp_path / "run", "input.sampling_column=params")
    predicted, made = verdicts(ov, engine)
    assert predicted == made == _expected(ROW_CASES)
    out = (tmp_path / "run").rglob("*")
    assert not any(SECRET in p.read_text(errors="replace") for p in out if p.is_file() and p.suffix == ".jsonl")


def test_a_messages_column_is_named_in_validate_and_the_run_log(
    tmp_path: Path, tiny_model_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Rows with their own `messages` are sent as they are: validate and the run's log say that the
    config's template and system prompt do not apply to them, and to how many rows."""
    corpus = tmp_path / "chat.jsonl"
    chat = [{"role": "user", "content": "hello world"}]
    corpus.write_text(
        json.dumps({"id": "a", "text": "hello", "messages": chat})
        + "\n"
        + json.dumps({"id": "b", "text": "world"})
        + "\n"
    )
    ov = run_overrides(tiny_model_path, corpus, tmp_path / "run", "prompt.system=Be brief.")
    note = (
        "1 of 2 rows have their own `messages`: each is sent as its own chat, as it is, without prompt.template, "
        "prompt.system (those apply to the other 1 rows)"
    )
    report = validate(compose(ov), jobs=1, progress=False)
    assert report["notes"] == [note]
    assert f"note         {note}" in format_report(report)
    with caplog.at_level("WARNING", logger="batchinfer"):
        run_local(compose(ov), engine=StandinEngine(compose(ov)))
    assert note in caplog.text
