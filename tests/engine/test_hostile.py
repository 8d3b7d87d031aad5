"""One row, one verdict (issue 41): a table of hostile values, each run through `batchinfer validate`
and through the worker on one corpus; validate must report exactly the rows the run makes error rows,
of the same kind. The stand-in engine runs the worker where it raises what vLLM raises; the real
engine (the session's shared one) where only vLLM's own behaviour proves it.

To add a case: a row of ROW_CASES (the row's own sampling values, through input.sampling_column),
of OPENAI_CASES (an OpenAI Batch request body), or a test of its own that builds a corpus and calls
`verdicts` (file-level problems: compare validate's stop with the run's refusal).

The second table, FILE_CASES: hostile input files and settings through the real CLI entry, each one
line naming the file, line or key and what to do (exit 2), never a traceback or a value changed
without a word, and a finished run directory beside them left exactly as it was."""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Optional

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from support.corpus import write_corpus
from support.fake_engine import FakeEngine, fake_overrides, keyed
from support.openai_batch import request
from support.runs import committed_rows, run_overrides
from support.standin import StandinEngine

from batchinfer.cli import main
from batchinfer.config.compose import compose
from batchinfer.inputs.convert import convert_input, open_input
from batchinfer.insight import findings
from batchinfer.insight.validate import validate
from batchinfer.insight.validate_report import format_report
from batchinfer.launch.local import run_local, run_shards
from batchinfer.rundir.merge import merge
from batchinfer.rundir.prepare import prepare

SECRET = "the private file's content must not reach any output"


SCHEMA_BAD_PATTERN = {"type": "string", "pattern": "("}
SCHEMA_REQUIRED_STR = {"type": "object", "properties": {"a": {"type": "string"}}, "required": "a"}
SCHEMA_MISSING_REF = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}
SCHEMA_EMPTY_LENGTH = {"type": "string", "minLength": 5, "maxLength": 2}
SCHEMA_REF = {"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}, "$defs": {"x": {"type": "integer"}}}


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
    # what vLLM's grammar backends refuse (xgrammar: model.compact_json, the default)
    Case("a regex comment group", {"structured_outputs": {"regex": "(?#c)a"}}, "sampling"),
    Case("a regex Unicode class (xgrammar)", {"structured_outputs": {"regex": "\\p{L}+"}}, "sampling"),
    Case("a regex inline flag (xgrammar)", {"structured_outputs": {"regex": "(?i)abc"}}, "sampling"),
    Case("a schema pattern that does not compile", {"structured_outputs": {"json": SCHEMA_BAD_PATTERN}}, "sampling"),
    Case("a schema whose required is no list", {"structured_outputs": {"json": SCHEMA_REQUIRED_STR}}, "sampling"),
    Case("a schema $ref to nothing", {"structured_outputs": {"json": SCHEMA_MISSING_REF}}, "sampling"),
    Case("a schema minLength above maxLength", {"structured_outputs": {"json": SCHEMA_EMPTY_LENGTH}}, "sampling"),
    Case("a grammar that is none", {"structured_outputs": {"grammar": "this is not a grammar"}}, "sampling"),
    Case("an empty grammar rule (xgrammar)", {"structured_outputs": {"grammar": "root ::= "}}, "sampling"),
    Case(
        "a structured flag that is no bool",
        {"structured_outputs": {"choice": ["a"], "disable_additional_properties": 5}},
        "sampling",
    ),
    Case("json_object false", {"structured_outputs": {"json_object": False}}, "sampling"),
    # values the engine core cannot decode (its input thread dies, the engine hangs)
    Case("max_tokens a decimal", {"max_tokens": 4.0}, "sampling"),
    Case("max_tokens true", {"max_tokens": True}, "sampling"),
    Case("ignore_eos 1", {"ignore_eos": 1}, "sampling"),
    Case("logprobs false", {"logprobs": False}, "sampling"),
    # JSON text in the column: an escaped half of a UTF-16 pair passes the file's text check, vLLM fails on it
    Case("a lone surrogate in a JSON-text choice", '{"structured_outputs": {"choice": ["\\udc00x"]}}', "sampling"),
    Case("a lone surrogate in a JSON-text stop", '{"stop": ["\\ud800"]}', "sampling"),
    # what vLLM takes, and so does batchinfer
    Case("stop one string", {"stop": "###", "max_tokens": 3}, None),
    Case("logprobs true", {"logprobs": True, "max_tokens": 3}, None),
    Case("json_object true", {"structured_outputs": {"json_object": True}, "max_tokens": 3}, None),
    Case("a fine grammar", {"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}}, None),
    Case("a fine schema with a $ref", {"structured_outputs": {"json": SCHEMA_REF}, "max_tokens": 3}, None),
]

# Under model.compact_json=false vLLM's backend is auto: xgrammar, and guidance for a schema xgrammar
# does not support (a format or pattern together with a length); what guidance refuses there.
SCHEMA_DATE_TOO_SHORT = {"type": "string", "format": "date", "maxLength": 3}
SCHEMA_URI_TEMPLATE = {"type": "string", "format": "uri-template", "maxLength": 200}
SCHEMA_REQUIRED_EMPTY = {"type": "object", "properties": {"d": SCHEMA_DATE_TOO_SHORT}, "required": ["d"]}
AUTO_CASES = [
    Case("fine", {"max_tokens": 3}, None),
    Case("a date of at most 3 characters", {"structured_outputs": {"json": SCHEMA_DATE_TOO_SHORT}}, "sampling"),
    Case(
        "a uuid of at most 35",
        {"structured_outputs": {"json": {"type": "string", "format": "uuid", "maxLength": 35}}},
        "sampling",
    ),
    Case(
        "an ipv4 of 16 or more",
        {"structured_outputs": {"json": {"type": "string", "format": "ipv4", "minLength": 16}}},
        "sampling",
    ),
    Case("a format guidance does not know", {"structured_outputs": {"json": SCHEMA_URI_TEMPLATE}}, "sampling"),
    Case("a required property no value meets", {"structured_outputs": {"json": SCHEMA_REQUIRED_EMPTY}}, "sampling"),
    Case(
        "an anchored pattern longer than maxLength",
        {"structured_outputs": {"json": {"type": "string", "pattern": "^[a-z]{10}$", "maxLength": 5}}},
        "sampling",
    ),
    Case(
        "a 3-digit pattern of 4 or more",
        {"structured_outputs": {"json": {"type": "string", "pattern": "^\\d{3}$", "minLength": 4}}},
        "sampling",
    ),
    Case(
        "an unanchored pattern of 46 or more",
        {"structured_outputs": {"json": {"type": "string", "pattern": "[a-z]", "minLength": 46}}},
        "sampling",
    ),
    # what guidance takes: a date of 10, an optional property no value meets, a format xgrammar judges alone
    Case(
        "a date of at most 10",
        {"structured_outputs": {"json": {"type": "string", "format": "date", "maxLength": 10}}, "max_tokens": 3},
        None,
    ),
    Case(
        "an optional property no value meets",
        {
            "structured_outputs": {"json": {"type": "object", "properties": {"d": SCHEMA_DATE_TOO_SHORT}}},
            "max_tokens": 3,
        },
        None,
    ),
    Case(
        "uri-template without a length (xgrammar)",
        {"structured_outputs": {"json": {"type": "string", "format": "uri-template"}}, "max_tokens": 3},
        None,
    ),
    Case(
        "an anchored pattern and a long minLength",
        {"structured_outputs": {"json": {"type": "string", "pattern": "^[a-z]+$", "minLength": 200}}, "max_tokens": 3},
        None,
    ),
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


def test_rows_under_the_auto_backend_validate_and_the_standin_worker_agree(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    """model.compact_json=false (vLLM's auto backend): a format or pattern with a length vLLM's guidance
    fallback refuses is the same error row in validate and in the run (validate called them fine)."""
    corpus = _row_corpus(tmp_path / "rows.jsonl", AUTO_CASES, tmp_path / "none.json")
    ov = run_overrides(
        tiny_model_path, corpus, tmp_path / "run", "input.sampling_column=params", "model.compact_json=false"
    )
    predicted, made = verdicts(ov, StandinEngine(compose(ov)))
    assert predicted == made == _expected(AUTO_CASES), [c.name for c in AUTO_CASES]


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


def test_what_only_vllm_refuses_is_an_error_row_and_no_row_in_flight_is_a_suspect(
    tmp_path: Path, tiny_model_path: Path, engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With batchinfer's own check of the rows' sampling switched off, vLLM itself refuses a row's
    logprobs above its cap (VLLMValidationError at add_request, no ValueError), a structured_outputs
    that is no object (AttributeError building the params) and max_tokens=4.0 (which SamplingParams
    keeps, and the engine core could not decode: its input thread would die, the engine hang; the
    engine checks the decoding first): each is its row's error row, the shard finishes, and the rows
    in flight meanwhile are answered, none charged as a suspect."""
    from batchinfer.requests import build

    monkeypatch.setattr(build, "check_row_sampling", lambda *a: None)
    cases = [Case("fine", {}, None)] * 6 + [
        Case("logprobs above the cap", {"logprobs": 50}, "sampling"),
        Case("structured_outputs not an object", {"structured_outputs": "junk"}, "sampling"),
        # SamplingParams keeps 4.0; the engine core's decoder refuses it and its input thread dies
        Case("max_tokens a decimal", {"max_tokens": 4.0}, "sampling"),
    ]
    corpus = _row_corpus(tmp_path / "rows.jsonl", [*cases, *cases[:6]], tmp_path / "none.json")
    ov = run_overrides(tiny_model_path, corpus, tmp_path / "run", "input.sampling_column=params")
    run = run_local(compose(ov), engine=engine)
    rows = committed_rows(run.path)
    errors = {row: r["error"] for row, r in rows.items() if r["error"]}
    assert {row: e["kind"] for row, e in errors.items()} == {6: "sampling", 7: "sampling", 8: "sampling"}
    assert "VLLMValidationError" in errors[6]["message"] and "AttributeError" in errors[7]["message"]
    assert "ValidationError: Expected `int | null`, got `float`" in errors[8]["message"]
    assert all(r["text"] for row, r in rows.items() if row not in errors) and len(rows) == 15
    progress = json.loads((run.shard_folder(0).path / "progress.json").read_text())
    assert not progress.get("suspects") and not progress.get("error"), progress


def test_a_huge_field_is_the_same_overlong_row_in_validate_and_the_run_and_neither_tokenizes_it(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    """A 4 MB field: `validate` and the worker make it the same overlong error row (`at least N
    tokens`, from its characters), and the engine's tokenizer never sees it (issue 41: the whole
    text was tokenized, 8.6 GB for 52 MB)."""
    corpus = tmp_path / "big.jsonl"
    big = "the quick brown fox jumps over the lazy dog. " * 90_000
    corpus.write_text("".join(json.dumps({"id": f"r{i}", "text": t}) + "\n" for i, t in enumerate(["hi", big, "yo"])))
    ov = run_overrides(tiny_model_path, corpus, tmp_path / "run")
    eng = StandinEngine(compose(ov))
    sizes: list[int] = []
    encode, render_many = eng.encode, eng.render_many
    eng.encode = lambda prompt, kw=None: sizes.append(len(str(prompt))) or encode(prompt, kw)  # type: ignore[method-assign]
    eng.render_many = lambda ps, kw=None: sizes.extend(len(str(p)) for p in ps) or render_many(ps, kw)  # type: ignore[method-assign]
    predicted, made = verdicts(ov, eng)
    assert predicted == made == {1: "overlong"}
    assert sizes and max(sizes) < 1000
    row = committed_rows(tmp_path / "run")[1]
    assert "prompt has at least" in row["error"]["message"]


def test_plan_counts_a_huge_field_from_its_characters(
    tmp_path: Path, tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`plan` samples rows as the worker builds them: a 4 MB field is counted as the fewest tokens it
    can have, never tokenized whole."""
    from batchinfer.insight.plan import estimate
    from batchinfer.models.tokens import LoginTokenizer

    corpus = tmp_path / "big.jsonl"
    big = "the quick brown fox jumps over the lazy dog. " * 90_000
    corpus.write_text("".join(json.dumps({"id": f"r{i}", "text": t}) + "\n" for i, t in enumerate(["hi", big])))
    sizes: list[int] = []
    encode = LoginTokenizer.encode
    monkeypatch.setattr(
        LoginTokenizer, "encode", lambda self, p, kw=None: sizes.append(len(str(p))) or encode(self, p, kw)
    )
    report = estimate(compose(run_overrides(tiny_model_path, corpus, tmp_path / "run")))
    assert max(sizes) < 1000 and report["prompt_tokens"]["tokenized_rows"] == 2, report["prompt_tokens"]


# ---------------------------------------------------------------- input files and settings

ROW = b'{"id": 1, "text": "a"}\n'
DEEP = "[" * 500 + "]" * 500


def _zst_corrupt() -> bytes:
    z = zstandard.ZstdCompressor().compress(ROW * 1000)
    return z[:10] + b"\0" * 20 + z[30:]


def _zst_cut_at_a_line() -> bytes:
    """The first 500 of 1000 distinct rows of a zstd frame, flushed as a block and cut there: whole lines."""
    rows = b"".join(b'{"id": %d, "text": "a"}\n' % i for i in range(1000))
    z = zstandard.ZstdCompressor().compressobj()
    return z.compress(rows[: rows.index(b'{"id": 500,')]) + z.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)


def _gz_cut() -> bytes:
    z = gzip.compress(ROW * 1000)
    return z[: len(z) // 2]


def _broken_model(name: str, content: bytes) -> Callable[[Path, Path], Path]:
    """A copy of the tiny model with one file replaced."""

    def make(tmp: Path, model: Path) -> Path:
        copy = tmp / f"model-{name.replace('.', '-')}"
        shutil.copytree(model, copy)
        (copy / name).write_bytes(content)
        return copy

    return make


LFS = b"version https://git-lfs.github.com/spec/v1\noid sha256:4d7a2146\nsize 12345\n"


@dataclass
class FileCase:
    """A corpus (file name -> bytes; the first is input.path), settings, the one line expected (str.format'd
    with d: the corpus folder, m: the model folder) and the commands that must all say it."""

    files: dict[str, bytes]
    line: str
    overrides: tuple[str, ...] = ()
    model: Any = None  # (tmp, tiny model) -> model folder, or None for the tiny model
    commands: tuple[str, ...] = ("validate",)
    extra: dict[str, Any] = field(default_factory=dict)


def _setting(line: str, *overrides: str) -> FileCase:
    """A setting vLLM would refuse at engine start: one line from validate, plan and run, before DIR."""
    return FileCase({"c.jsonl": ROW}, line, overrides=overrides, commands=("validate", "plan", "run"))


FILE_CASES = {
    "id above int64": FileCase(
        {"c.jsonl": ROW + b'{"id": 18446744073709551616, "text": "b"}\n'},
        "{d}/c.jsonl:2: id 18446744073709551616 is an integer beyond 64 bits, which would make every id a float "
        '(exact only to 2**53, so distinct ids could collide); write the ids as JSON strings ("18446744073709551616")',
    ),
    "integer ids beside a decimal one": FileCase(
        {"c.jsonl": ROW + b'{"id": 2.5, "text": "b"}\n'},
        "{d}/c.jsonl:1: id 1 is an integer but the id at {d}/c.jsonl:2 is a decimal: the column would hold floats "
        "(1 read as 1.0); write every id as an integer, or all as JSON strings",
    ),
    "CSV header naming a column twice": FileCase(
        {"c.csv": b"id,text,text\n1,a,b\n"},
        "{d}/c.csv:1: the header names column 'text' twice (columns 2 and 3); give each column its own name",
        commands=("validate", "plan"),
    ),
    "a null first line (pyarrow crashed the process)": FileCase(
        {"c.jsonl": b"null\n" + ROW},
        '{d}/c.jsonl:1: expected a JSON object per line, got null; write the row as one object ({{"text": ...}}) or '
        "remove the line",
        commands=("validate", "run"),
    ),
    "a null line (read as a row of nulls)": FileCase(
        {"c.jsonl": ROW + b"null\n"},
        '{d}/c.jsonl:2: expected a JSON object per line, got null; write the row as one object ({{"text": ...}}) or '
        "remove the line",
        commands=("validate", "run"),
    ),
    "an integer beyond 64 bits in a column (made it floats)": FileCase(
        {"c.jsonl": b'{"id": 1, "text": "a", "n": 1}\n{"id": 2, "text": "b", "n": 18446744073709551617}\n'},
        "{d}/c.jsonl:2: column 'n' holds the integer 18446744073709551617, beyond 64 bits: the column would be read "
        'as floats (18446744073709551617 as 1.8446744073709552e+19); write such numbers as JSON strings ("18446744073709551617")',
        commands=("validate", "run"),
    ),
    "Infinity in a sampling column kept as JSON text (read as null)": FileCase(
        {
            "c.jsonl": b'{"id": 1, "text": "a", "p": {"top_p": 0.5}}\n{"id": 2, "text": "b", "p": {"temperature": Infinity}}\n'
        },
        "{d}/c.jsonl:2: column 'p' (kept as JSON text: its objects' keys differ from row to row) holds the number "
        'Infinity, which JSON text cannot hold: it would be read as null; write it as a JSON string ("Infinity") or '
        "a finite number",
        overrides=("input.sampling_column=p",),
        commands=("validate", "run"),
    ),
    "an id that is an object": FileCase(
        {"c.jsonl": b'{"id": {"a": 1}, "text": "a"}\n'},
        "{d}/c.jsonl: row 0: input.id_column 'id' is an object ({{\"a\": 1}}); an id is one string or number: give "
        "every row such an id, or set input.id_column to another column (unset, rows are numbered)",
        commands=("validate", "run"),
    ),
    "an integer id beside a string one (the shard failed on every attempt)": FileCase(
        {"c.jsonl": ROW + b'{"id": "b", "text": "b"}\n'},
        "{d}/c.jsonl: row 0: input.id_column 'id' is the number 1 but row 1's is the string \"b\": an id column "
        'holds one type; write every id as a JSON string ("1"), or every id as a number',
        commands=("validate", "run"),
    ),
    "a NaN id (two were not duplicates)": FileCase(
        {"c.jsonl": b'{"id": 1.5, "text": "a"}\n{"id": NaN, "text": "b"}\n{"id": NaN, "text": "c"}\n'},
        "{d}/c.jsonl: row 1: input.id_column 'id' is nan, not a finite number (NaN equals no id, not even itself, "
        "so duplicates would go unseen); give every row a finite number or a string as its id",
        commands=("validate", "run"),
    ),
    "a CSV that is not UTF-8 (plan named no line)": FileCase(
        {"c.csv": b"id,text\n1,caf\xe9\n"},
        "{d}/c.csv:2: invalid UTF-8 at byte 5 of the line, file offset 13; re-encode the file as UTF-8",
        commands=("validate", "plan", "run"),
    ),
    "input.id_column naming no column (plan: KeyError)": FileCase(
        {"c.jsonl": ROW},
        "{d}/c.jsonl: input.id_column='nope' is not a column (columns: id, text)",
        overrides=("input.id_column=nope",),
        commands=("validate", "plan", "run"),
    ),
    "a row without its id (plan: KeyError)": FileCase(
        {"c.jsonl": ROW + b'{"text": "b"}\n'},
        "{d}/c.jsonl: input.id_column 'id' is null or missing in some rows; every row needs an id",
        commands=("plan",),  # validate lists it among its report's stops; run names the row
    ),
    "an empty CSV id cell (was the id '')": FileCase(
        {"c.csv": b"id,text\n1,a\n,b\n"},
        "{d}/c.csv: row 1: input.id_column 'id' is null or missing; every row needs an id",
        commands=("run",),  # validate lists it among the stops of its report
    ),
    "a CSV record with a cell more than the header (pandas shifted every value)": FileCase(
        {"c.csv": b"id,text\n1,a,b\n2,c,d\n"},
        "{d}/c.csv:2: 3 cells but the header names 2 columns (a record must have one cell per column); quote a cell "
        "holding ',' or a newline, or fix the record",
        commands=("validate", "run"),
    ),
    "a .json document that is null (pyarrow crashed the process)": FileCase(
        {"c.json": b"null\n"},
        '{d}/c.json:1: the document is null, not rows: a JSON input is an array (one object per row, [{{"text": ...}}, '
        "...]) or one object per line",
        commands=("validate", "run"),
    ),
    "a .json array with a number among its rows": FileCase(
        {"c.json": b'[{"id": 1, "text": "a"},\n 5]\n'},
        "{d}/c.json:2: item 1 of the array is a number; its items must all be objects (one per row), as the first "
        "is: fix or remove that item",
        commands=("validate", "run"),
    ),
    "a .zst cut inside a frame at a line's end (read as a shorter corpus)": FileCase(
        {"c.jsonl.zst": _zst_cut_at_a_line()},
        "{d}/c.jsonl.zst: cannot be decompressed as zst (the file ends inside a zstd frame); the file is cut short, "
        "corrupt or not zst data: copy it again, or rename it without .zst if it is not compressed",
        commands=("validate", "run"),
    ),
    "truncated gz": FileCase(
        {"c.jsonl.gz": _gz_cut()},
        "{d}/c.jsonl.gz: cannot be decompressed as gz (Compressed file ended before the end-of-stream marker was "
        "reached); the file is cut short, corrupt or not gz data: copy it again, or rename it without .gz if it "
        "is not compressed",
        commands=("validate", "plan", "run"),
    ),
    "plain text named gz": FileCase(
        {"c.jsonl.gz": ROW},
        "{d}/c.jsonl.gz: cannot be decompressed as gz (Not a gzipped file (b'{{\"')); the file is cut short, "
        "corrupt or not gz data: copy it again, or rename it without .gz if it is not compressed",
        commands=("validate", "plan", "run"),
    ),
    "corrupt zst": FileCase(
        {"c.jsonl.zst": _zst_corrupt()},
        "{d}/c.jsonl.zst: cannot be decompressed as zst (zstd decompressor error: Data corruption detected); the "
        "file is cut short, corrupt or not zst data: copy it again, or rename it without .zst if it is not compressed",
        commands=("validate", "plan", "run"),
    ),
    "truncated gz CSV": FileCase(
        {"c.csv.gz": gzip.compress(b"id,text\n1,a\n" * 100)[:40]},
        "{d}/c.csv.gz: cannot be decompressed as gz (Compressed file ended before the end-of-stream marker was "
        "reached); the file is cut short, corrupt or not gz data: copy it again, or rename it without .gz if it "
        "is not compressed",
    ),
    "JSON nested 500 levels": FileCase(
        {"c.jsonl": ROW + f'{{"id": 2, "text": "b", "x": {DEEP}}}\n'.encode()},
        "{d}/c.jsonl:2: objects and lists nested 501 levels deep (the row's own object counts as one); at most 63 "
        "can be read: flatten the value or write it as JSON text (a quoted string)",
        commands=("validate", "run"),
    ),
    "JSON nested 100,000 levels (pyarrow's inference crashed)": FileCase(
        {"c.jsonl": ROW + ('{"id": 2, "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n").encode()},
        "{d}/c.jsonl:2: objects and lists nested 100001 levels deep (the row's own object counts as one); at most "
        "63 can be read: flatten the value or write it as JSON text (a quoted string)",
    ),
    "OpenAI request nested 500 levels": FileCase(
        {
            "c.jsonl": json.dumps(
                {"custom_id": "a", "body": {"messages": [{"role": "user", "content": "hi"}], "metadata": {}}}
            ).encode()
            + b"\n"
            + (
                '{"custom_id": "b", "body": {"messages": [{"role": "user", "content": "hi"}], "stop": ' + DEEP + "}}\n"
            ).encode()
        },
        "{d}/c.jsonl:2: objects and lists nested 502 levels deep (the row's own object counts as one); at most 63 "
        "can be read: flatten the value or write it as JSON text (a quoted string)",
        overrides=("input.id_column=null",),
    ),
    "duplicate JSON key": FileCase(
        {"c.jsonl": ROW + b'{"id": 2, "text": "a", "text": "b"}\n'},
        "{d}/c.jsonl:2: key 'text' appears twice in one object; remove or rename one",
    ),
    "number past float64": FileCase(
        {"c.jsonl": ROW + b'{"id": 2, "text": "a", "n": 1e99999}\n'},
        '{d}/c.jsonl:2: the number 1e99999 is too big for a 64-bit float; write it as a JSON string ("1e99999")',
    ),
    "integer past 64 bits in a JSON document": FileCase(
        {"c.json": b'[{"id": 1, "text": "a"},\n {"id": 2, "text": "a", "n": 123456789012345678901234567890}]\n'},
        "{d}/c.json:2:30: the integer 123456789012345678901234567890 does not fit 64 bits; write it as a JSON "
        'string ("123456789012345678901234567890") or a decimal',
    ),
    "unterminated string (was 'at at column')": FileCase(
        {"c.jsonl": ROW + b'{"id": 2, "text": "a}'},
        "{d}/c.jsonl:2: not valid JSON (Unterminated string starting at column 19); fix or remove the line",
    ),
    "template file not UTF-8": FileCase(
        {"c.jsonl": ROW, "t.txt": b"Say:\n\xff{text}"},
        "prompt.template_file {d}/t.txt:2: invalid UTF-8 (byte 0xff); save the file as UTF-8",
        overrides=("prompt.template_file={d}/t.txt",),
    ),
    "absurd format width": FileCase(
        {"c.jsonl": ROW},
        "prompt.template {{text:>1000000000000}}: a width or precision of 1000000000000 characters; at most "
        "100000 (a prompt that long fits no model)",
        overrides=("prompt.template={{text:>1000000000000}}",),
    ),
    "key below a key that is no section": FileCase(
        {"c.jsonl": ROW},
        "sampling.foo is not a key; sampling keys are: temperature, top_p, top_k, min_p, max_tokens, min_tokens, "
        "n, seed, seed_per_row, logprobs, stop, presence_penalty, frequency_penalty, repetition_penalty, "
        "ignore_eos, skip_special_tokens, structured_outputs",
        overrides=("sampling.foo.bar=1",),
    ),
    "sampling.temperature=inf": _setting(
        "sampling.temperature=inf is not a finite number: vLLM refuses inf and nan; it takes a finite number in "
        "[0, 2] (0 is greedy)",
        "sampling.temperature=inf",
    ),
    "sampling.seed at 2^63": _setting(
        "sampling.seed=9223372036854775808 is out of range: it takes an integer in [-2^63, 2^63)",
        "sampling.seed=9223372036854775808",
    ),
    "model.engine_kwargs naming no EngineArgs field": _setting(
        "model.engine_kwargs.max_num_seq is not an argument of vLLM's EngineArgs (did you mean max_num_seqs?): "
        "vLLM would refuse it at engine start; remove it, or spell it as `vllm serve --help` lists it (with _ for -)",
        "+model.engine_kwargs.max_num_seq=4",
    ),
    "a regex vLLM's grammar backends refuse": _setting(
        "sampling.structured_outputs.regex='(?=a)a' is refused by vLLM: it takes a regex without '(?=' "
        "(lookarounds, backreferences, word boundaries are not supported)",
        "sampling.structured_outputs.regex=(?=a)a",
    ),
    "a regex flag vLLM's xgrammar backend refuses": _setting(
        "sampling.structured_outputs.regex='(?i)abc' is refused by vLLM: it takes a regex without '(?i)' under "
        "vLLM's xgrammar backend (inline flags and (?P<name> groups are not supported; write (?<name>...) or "
        "(?:...), or set model.compact_json=false: vLLM then falls back to guidance, which takes them)",
        "sampling.structured_outputs.regex=(?i)abc",
    ),
    "a grammar that does not parse": _setting(
        "sampling.structured_outputs.grammar='this is not a grammar' is refused by vLLM: it takes a valid Lark "
        "grammar (line 1 is neither a rule (`name: ...`) nor an alternative starting with |)",
        "sampling.structured_outputs.grammar=this is not a grammar",
    ),
    "a schema file whose required is no list": FileCase(
        {"c.jsonl": ROW, "s.json": b'{"type": "object", "required": "a"}'},
        "sampling.structured_outputs.json {d}/s.json: not a JSON schema: the schema has \"required\": 'a'; it "
        'takes a list of property names, e.g. ["name"]',
        overrides=("sampling.structured_outputs.json={d}/s.json",),
        commands=("validate", "plan", "run"),
    ),
    "a schema file vLLM's xgrammar backend refuses": FileCase(
        {"c.jsonl": ROW, "s.json": b'{"type": "integer", "multipleOf": 2}'},
        "sampling.structured_outputs.json='{d}/s.json' is refused by vLLM: it takes a JSON schema: the schema uses "
        "multipleOf, which vLLM's xgrammar backend does not support (model.compact_json=true); set "
        "model.compact_json=false (vLLM then falls back to guidance) or simplify the schema",
        overrides=("sampling.structured_outputs.json={d}/s.json",),
        commands=("validate", "plan", "run"),
    ),
    "top_k above the vocabulary": _setting(
        "sampling.top_k=1000 is out of range: it takes at most the vocabulary's 330 tokens (0 or -1: all of them)",
        "sampling.top_k=1000",
        "sampling.temperature=0.5",
    ),
    "config.json not JSON": FileCase(
        {"c.jsonl": ROW},
        "{m}/config.json:1:1: not valid JSON (Expecting value); copy the model folder again or fix the file",
        model=_broken_model("config.json", b"not json{"),
        commands=("validate", "plan"),
    ),
    "tokenizer.json corrupt": FileCase(
        {"c.jsonl": ROW},
        "{m}/tokenizer.json: not a tokenizer the `tokenizers` library reads (EOF while parsing a value at line 1 "
        "column 11); copy the model folder again",
        model=_broken_model("tokenizer.json", b'{"version":'),
    ),
    "tokenizer.json a git-lfs pointer": FileCase(
        {"c.jsonl": ROW},
        "{m}/tokenizer.json: a git-lfs pointer, not the file itself; run `git lfs pull` in {m} (or download the "
        "model again)",
        model=_broken_model("tokenizer.json", LFS),
    ),
    "chat template syntax error": FileCase(
        {"c.jsonl": ROW},
        "{m}/chat_template.jinja:2: the chat template does not compile (Expected an expression, got 'end of "
        "statement block'); fix it or use prompt.mode=raw",
        model=_broken_model("chat_template.jinja", b"{{ messages }}\n{% if %}\n"),
    ),
}


def _tree(folder: Path) -> dict[str, tuple[str, int]]:
    """Every file below folder: its content digest and mtime."""
    return {
        str(p.relative_to(folder)): (hashlib.blake2b(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished, merged run directory (fake engine) that no refused command may touch."""
    tmp = tmp_path_factory.mktemp("finished")
    corpus = tmp / "c.jsonl"
    write_corpus(corpus, 12)
    run = prepare(compose(fake_overrides(tmp, corpus, "input.id_column=id", "sharding.num_shards=2")))
    run_shards(run, [0, 1], engine=keyed(FakeEngine(), run))
    merge(run)
    return run.path


def _error_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str]:
    """The CLI's exit code and its first `batchinfer: error:` line (without the prefix)."""
    code = main(argv)
    err = capsys.readouterr().err
    lines = [ln.removeprefix("batchinfer: error: ") for ln in err.splitlines() if ln.startswith("batchinfer: error:")]
    return code, lines[0] if lines else err[-2000:]


@pytest.mark.parametrize("name", list(FILE_CASES))
def test_hostile_file_or_setting_is_one_line(
    name: str, tmp_path: Path, tiny_model_path: Path, finished: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    case = FILE_CASES[name]
    for file, data in case.files.items():
        (tmp_path / file).write_bytes(data)
    model = case.model(tmp_path, tiny_model_path) if case.model else tiny_model_path
    overrides = [o.format(d=tmp_path) for o in case.overrides]
    base = [f"input.path={tmp_path / next(iter(case.files))}", f"model.path={model}", "input.id_column=id"]
    before = _tree(finished)
    for command in case.commands:
        out = finished if command != "run" else tmp_path / "fresh"
        argv = [command, *base, "model.max_model_len=128", f"output.dir={out}", *overrides]
        assert _error_line(capsys, argv) == (2, case.line.format(d=tmp_path, m=model)), command
        assert not (tmp_path / "fresh").exists()  # a refused run makes no run directory
    assert _tree(finished) == before


@pytest.mark.parametrize(
    "where",
    ["(" * 5000 + "row > 1" + ")" * 5000, "not " * 5000 + "row > 1", " or ".join(["row > 1"] * 20000)],
    ids=["5000 parentheses", "5000 nots", "20000 ors (pyarrow crashed)"],
)
def test_hostile_where_is_one_line(finished: Path, where: str, capsys: pytest.CaptureFixture[str]) -> None:
    before = _tree(finished)
    code, line = _error_line(capsys, ["redo", str(finished), "--where", where])
    assert code == 2
    expected = {
        "(": "--where at character 101: more than 100 nested `not`s and parentheses; write a simpler expression, "
        "got '('",
        "n": "--where at character 401: more than 100 nested `not`s and parentheses; write a simpler expression, "
        "got 'not'",
        "r": "--where at character 10998: more than 1000 tests joined by `and`/`or`; write a shorter expression, "
        "got 'or'",
    }
    assert line == expected[where[0]]
    assert _tree(finished) == before


def _converted(tmp_path: Path, text: bytes, id_column: str = "id", fmt: str = "jsonl") -> list[dict[str, Any]]:
    corpus = tmp_path / f"c.{fmt}"
    corpus.write_bytes(text)
    dest = tmp_path / "input"
    shutil.rmtree(dest, ignore_errors=True)
    convert_input([corpus], fmt, dest, id_column, None)
    return open_input(dest).to_list()


def test_iso_dates_stay_text(tmp_path: Path) -> None:
    """Strings that look like dates are not turned into timestamps, on the fast path and on
    `datasets`' own reading (objects whose keys vary take that one, and JSON documents)."""
    plain = b'{"id": "2024-02-29", "text": "2024-02-29"}\n{"id": "2024-03-01", "text": "2024-03-01T10:00:00Z"}\n'
    assert _converted(tmp_path, plain) == [
        {"id": "2024-02-29", "text": "2024-02-29"},
        {"id": "2024-03-01", "text": "2024-03-01T10:00:00Z"},
    ]
    varying = (
        b'{"id": "2024-02-29", "text": "2024-02-29", "o": {"a": 1}}\n'
        b'{"id": "2024-03-01", "text": "2024-03-01T10:00:00Z", "o": {"b": 2}}\n'
    )
    rows = _converted(tmp_path, varying)
    assert [(r["id"], r["text"]) for r in rows] == [
        ("2024-02-29", "2024-02-29"),
        ("2024-03-01", "2024-03-01T10:00:00Z"),
    ]
    document = b"[" + plain.strip().replace(b"\n", b",\n") + b"]\n"  # a JSON document: `datasets` reads it
    assert _converted(tmp_path, document, fmt="json") == _converted(tmp_path, plain)


def test_ids_keep_their_value_and_type(tmp_path: Path) -> None:
    """Integer ids up to int64 stay integers, and 2**53 and 2**53 + 1 stay two ids."""
    text = b'{"id": 2, "text": "a"}\n{"id": 9007199254740992, "text": "b"}\n{"id": 9007199254740993, "text": "c"}\n'
    assert [r["id"] for r in _converted(tmp_path, text)] == [2, 2**53, 2**53 + 1]


def test_a_parquet_map_column_no_setting_uses_is_left_out(
    tmp_path: Path, tiny_model_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = tmp_path / "c.parquet"
    kv = pa.map_(pa.string(), pa.string())
    pq.write_table(
        pa.table({"id": [1, 2], "text": ["a", "b"], "m": pa.array([[("k", "v")], [("x", "y")]], kv)}), corpus
    )
    base = ["validate", f"input.path={corpus}", f"model.path={tiny_model_path}", "model.max_model_len=128"]
    assert main(base) == 0
    assert "column 'm' (map<string, string ('m')>) is left out: it has no `datasets` type" in capsys.readouterr().err
    assert _error_line(capsys, [*base, "prompt.template={m}"]) == (
        2,
        f"prompt.template uses {{m}} but {corpus} has no column 'm' (columns: id, text); a literal {{ or }} in a "
        "template is written {{ or }}",
    )


def test_sampling_text_nested_too_deep_is_an_error_row(tmp_path: Path, tiny_model_path: Path) -> None:
    """A row's sampling column holding JSON text nested 100,000 levels (json.loads raised RecursionError,
    a traceback in validate, the shard failed in the worker) is its row's error row in both."""
    corpus = tmp_path / "rows.jsonl"
    deep = '{"stop": ' + "[" * 100_000 + "]" * 100_000 + "}"
    lines = [{"id": 0, "text": "a", "params": "{}"}, {"id": 1, "text": "b", "params": deep}]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in lines))
    ov = run_overrides(tiny_model_path, corpus, tmp_path / "run", "input.sampling_column=params")
    report = validate(compose(ov), jobs=1, progress=False)
    (example,) = report["error_rows"]["by_kind"]["sampling"]["examples"]
    assert example["message"] == "row 1: field 'params' nests objects and lists past 63 levels; flatten it"
    predicted, made = verdicts(ov, StandinEngine(compose(ov)))
    assert predicted == made == {1: "sampling"}
