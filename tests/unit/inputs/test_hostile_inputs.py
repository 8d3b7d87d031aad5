"""Hostile input files and settings through the real CLI entry (issue 41): each is one line naming
the file, line or key and what to do (exit 2), never a traceback or a value changed without a word,
and a finished run directory beside them is left exactly as it was."""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from support.corpus import write_corpus
from support.fake_engine import FakeEngine, fake_overrides, keyed

from batchinfer.cli import main
from batchinfer.config.compose import compose
from batchinfer.inputs.convert import convert_input, open_input
from batchinfer.launch.local import run_shards
from batchinfer.rundir.merge import merge
from batchinfer.rundir.prepare import prepare

ROW = b'{"id": 1, "text": "a"}\n'
DEEP = "[" * 500 + "]" * 500


def _zst_corrupt() -> bytes:
    z = zstandard.ZstdCompressor().compress(ROW * 1000)
    return z[:10] + b"\0" * 20 + z[30:]


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
class Case:
    """A corpus (file name -> bytes; the first is input.path), settings, the one line expected (str.format'd
    with d: the corpus folder, m: the model folder) and the commands that must all say it."""

    files: dict[str, bytes]
    line: str
    overrides: tuple[str, ...] = ()
    model: Any = None  # (tmp, tiny model) -> model folder, or None for the tiny model
    commands: tuple[str, ...] = ("validate",)
    extra: dict[str, Any] = field(default_factory=dict)


CASES = {
    "id above int64": Case(
        {"c.jsonl": ROW + b'{"id": 18446744073709551616, "text": "b"}\n'},
        "{d}/c.jsonl:2: id 18446744073709551616 is an integer beyond 64 bits, which would make every id a float "
        '(exact only to 2**53, so distinct ids could collide); write the ids as JSON strings ("18446744073709551616")',
    ),
    "integer ids beside a decimal one": Case(
        {"c.jsonl": ROW + b'{"id": 2.5, "text": "b"}\n'},
        "{d}/c.jsonl:1: id 1 is an integer but the id at {d}/c.jsonl:2 is a decimal: the column would hold floats "
        "(1 read as 1.0); write every id as an integer, or all as JSON strings",
    ),
    "CSV header naming a column twice": Case(
        {"c.csv": b"id,text,text\n1,a,b\n"},
        "{d}/c.csv:1: the header names column 'text' twice (columns 2 and 3); give each column its own name",
        commands=("validate", "plan"),
    ),
    "truncated gz": Case(
        {"c.jsonl.gz": _gz_cut()},
        "{d}/c.jsonl.gz: cannot be decompressed as gz (Compressed file ended before the end-of-stream marker was "
        "reached); the file is cut short, corrupt or not gz data: copy it again, or rename it without .gz if it "
        "is not compressed",
        commands=("validate", "plan", "run"),
    ),
    "plain text named gz": Case(
        {"c.jsonl.gz": ROW},
        "{d}/c.jsonl.gz: cannot be decompressed as gz (Not a gzipped file (b'{{\"')); the file is cut short, "
        "corrupt or not gz data: copy it again, or rename it without .gz if it is not compressed",
        commands=("validate", "plan", "run"),
    ),
    "corrupt zst": Case(
        {"c.jsonl.zst": _zst_corrupt()},
        "{d}/c.jsonl.zst: cannot be decompressed as zst (zstd decompress error: Data corruption detected); the "
        "file is cut short, corrupt or not zst data: copy it again, or rename it without .zst if it is not compressed",
        commands=("validate", "plan", "run"),
    ),
    "truncated gz CSV": Case(
        {"c.csv.gz": gzip.compress(b"id,text\n1,a\n" * 100)[:40]},
        "{d}/c.csv.gz: cannot be decompressed as gz (Compressed file ended before the end-of-stream marker was "
        "reached); the file is cut short, corrupt or not gz data: copy it again, or rename it without .gz if it "
        "is not compressed",
    ),
    "JSON nested 500 levels": Case(
        {"c.jsonl": ROW + f'{{"id": 2, "text": "b", "x": {DEEP}}}\n'.encode()},
        "{d}/c.jsonl:2: objects and lists nested 501 levels deep (the row's own object counts as one); at most 63 "
        "can be read: flatten the value or write it as JSON text (a quoted string)",
        commands=("validate", "run"),
    ),
    "JSON nested 100,000 levels (pyarrow's inference crashed)": Case(
        {"c.jsonl": ROW + ('{"id": 2, "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n").encode()},
        "{d}/c.jsonl:2: objects and lists nested 100001 levels deep (the row's own object counts as one); at most "
        "63 can be read: flatten the value or write it as JSON text (a quoted string)",
    ),
    "OpenAI request nested 500 levels": Case(
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
    "duplicate JSON key": Case(
        {"c.jsonl": ROW + b'{"id": 2, "text": "a", "text": "b"}\n'},
        "{d}/c.jsonl:2: key 'text' appears twice in one object; remove or rename one",
    ),
    "number past float64": Case(
        {"c.jsonl": ROW + b'{"id": 2, "text": "a", "n": 1e99999}\n'},
        '{d}/c.jsonl:2: the number 1e99999 is too big for a 64-bit float; write it as a JSON string ("1e99999")',
    ),
    "integer past 64 bits in a JSON document": Case(
        {"c.json": b'[{"id": 1, "text": "a"},\n {"id": 2, "text": "a", "n": 123456789012345678901234567890}]\n'},
        "{d}/c.json:2:30: the integer 123456789012345678901234567890 does not fit 64 bits; write it as a JSON "
        'string ("123456789012345678901234567890") or a decimal',
    ),
    "unterminated string (was 'at at column')": Case(
        {"c.jsonl": ROW + b'{"id": 2, "text": "a}'},
        "{d}/c.jsonl:2: not valid JSON (Unterminated string starting at column 19); fix or remove the line",
    ),
    "template file not UTF-8": Case(
        {"c.jsonl": ROW, "t.txt": b"Say:\n\xff{text}"},
        "prompt.template_file {d}/t.txt:2: invalid UTF-8 (byte 0xff); save the file as UTF-8",
        overrides=("prompt.template_file={d}/t.txt",),
    ),
    "absurd format width": Case(
        {"c.jsonl": ROW},
        "prompt.template {{text:>1000000000000}}: a width or precision of 1000000000000 characters; at most "
        "100000 (a prompt that long fits no model)",
        overrides=("prompt.template={{text:>1000000000000}}",),
    ),
    "key below a key that is no section": Case(
        {"c.jsonl": ROW},
        "sampling.foo is not a key; sampling keys are: temperature, top_p, top_k, min_p, max_tokens, min_tokens, "
        "n, seed, seed_per_row, logprobs, stop, presence_penalty, frequency_penalty, repetition_penalty, "
        "ignore_eos, skip_special_tokens, structured_outputs",
        overrides=("sampling.foo.bar=1",),
    ),
    "config.json not JSON": Case(
        {"c.jsonl": ROW},
        "{m}/config.json:1:1: not valid JSON (Expecting value); copy the model folder again or fix the file",
        model=_broken_model("config.json", b"not json{"),
        commands=("validate", "plan"),
    ),
    "tokenizer.json corrupt": Case(
        {"c.jsonl": ROW},
        "{m}/tokenizer.json: not a tokenizer the `tokenizers` library reads (EOF while parsing a value at line 1 "
        "column 11); copy the model folder again",
        model=_broken_model("tokenizer.json", b'{"version":'),
    ),
    "tokenizer.json a git-lfs pointer": Case(
        {"c.jsonl": ROW},
        "{m}/tokenizer.json: a git-lfs pointer, not the file itself; run `git lfs pull` in {m} (or download the "
        "model again)",
        model=_broken_model("tokenizer.json", LFS),
    ),
    "chat template syntax error": Case(
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


@pytest.mark.parametrize("name", list(CASES))
def test_hostile_input_is_one_line(
    name: str, tmp_path: Path, tiny_model_path: Path, finished: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    case = CASES[name]
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


def _converted(tmp_path: Path, text: bytes, id_column: str = "id") -> list[dict[str, Any]]:
    corpus = tmp_path / "c.jsonl"
    corpus.write_bytes(text)
    dest = tmp_path / "input"
    shutil.rmtree(dest, ignore_errors=True)
    convert_input([corpus], "jsonl", dest, id_column, None)
    return open_input(dest).to_list()


def test_iso_dates_stay_text(tmp_path: Path) -> None:
    """Strings that look like dates are not turned into timestamps, on the fast path and on
    `datasets`' own reading (objects whose keys vary take that one)."""
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
