"""Reading inputs: shard plans, JSON lines errors by line, missing and empty input, ids and template fields."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.fake_engine import fake_overrides
from support.runs import fake_model_dir

from batchinfer.config.compose import compose
from batchinfer.errors import ConfigError, InputError
from batchinfer.inputs.shards import Shard, plan_shards
from batchinfer.inputs.textfiles import scan_jsonl
from batchinfer.rundir.prepare import prepare


def test_plan_shards_by_count_and_size() -> None:
    assert plan_shards(10, 3, None, 100) == [Shard(0, 0, 3), Shard(1, 3, 6), Shard(2, 6, 10)]
    assert plan_shards(10, None, 4, 100) == [Shard(0, 0, 4), Shard(1, 4, 8), Shard(2, 8, 10)]
    assert plan_shards(5, None, None, 100) == [Shard(0, 0, 5)]
    assert plan_shards(2, 5, None, 100) == [Shard(0, 0, 1), Shard(1, 1, 2)]


def test_scan_jsonl_names_the_line(tmp_path: Path) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_bytes(b'{"text": "a"}\n{"text": "b"}\n{"text": oops}\n')
    with pytest.raises(InputError) as e:
        scan_jsonl(p)
    assert str(e.value) == f"{p}:3: not valid JSON (Expecting value at column 10); fix or remove the line"
    p.write_bytes(b'{"text": "a"}\n{"text": "\xff"}\n')
    with pytest.raises(InputError) as e:
        scan_jsonl(p)
    assert str(e.value) == f"{p}:2: invalid UTF-8 at byte 10 of the line, file offset 24; re-encode the file as UTF-8"


def test_missing_and_empty_input(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"input.path .*nope.jsonl: no such file"):
        prepare(compose(fake_overrides(tmp_path, tmp_path / "nope.jsonl")))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(InputError, match=r"empty.jsonl: no rows \(the file is empty\); there is nothing to run"):
        prepare(compose(fake_overrides(tmp_path, tmp_path / "empty.jsonl")))


def test_duplicate_ids_and_unknown_template_field(tmp_path: Path) -> None:
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "a", "text": "x"}\n{"id": "b", "text": "y"}\n{"id": "a", "text": "z"}\n')
    with pytest.raises(InputError, match=r"duplicate id 'a' in rows 0 and 2; ids must be unique"):
        prepare(compose(fake_overrides(tmp_path, corpus, "input.id_column=id")))
    corpus.write_text('{"id": "a", "text": "x"}\n{"text": "y"}\n{"id": null, "text": "z"}\n')
    with pytest.raises(InputError) as e:
        prepare(compose(fake_overrides(tmp_path, corpus, "input.id_column=id")))
    assert str(e.value) == f"{corpus}: row 1: input.id_column 'id' is null or missing; every row needs an id"
    assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match=r"uses \{body\} .* no column 'body' .*\{\{ or \}\}"):
        prepare(compose(fake_overrides(tmp_path, corpus, "prompt.template=Say {body}")))


def test_a_lone_surrogate_is_named_by_file_line_and_field(tmp_path: Path) -> None:
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(
        '{"id": "a", "text": "ok \\ud83d\\ude00"}\n\n{"id": "b", "meta": {"t": "x"}, "text": "bad \\ud800"}\n'
    )
    ov = [
        f"input.path={corpus}",
        "input.id_column=id",
        f"model.path={fake_model_dir(tmp_path)}",
        f"output.dir={tmp_path}/r",
    ]
    with pytest.raises(InputError, match=r"c.jsonl:3: field 'text' holds a lone UTF-16 surrogate \(\\ud800\)"):
        prepare(compose(ov))
    corpus.write_text('{"id": "a", "text": "ok \\ud83d\\ude00"}\n')  # a whole pair is text
    assert prepare(compose(ov)).exists()
