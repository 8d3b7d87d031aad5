"""Labels, JSON schemas, reasoning, per-row sampling and every output layout, on the real engine."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import datasets
import pyarrow.parquet as pq
import pytest
from support.corpus import assert_exactly_once, read_output, write_corpus
from support.runs import run_overrides as overrides

from batchinfer.config.compose import compose
from batchinfer.config.schema import to_config, to_dict
from batchinfer.durable import read_json
from batchinfer.errors import ConfigError, InputError
from batchinfer.launch.local import run_local

pytestmark = pytest.mark.engine


def test_labels_preset_writes_label_and_confidence(tmp_path: Path, tiny_model_path: Path, engine: Any) -> None:
    corpus = tmp_path / "c.jsonl"
    rows = write_corpus(corpus, 12, seed=21)
    ov = overrides(
        tiny_model_path,
        corpus,
        tmp_path / "run",
        "prompt=labels",
        "prompt.labels.names=[physics,biology,chemistry]",
        "prompt.labels.description=Which field is this text from?",
        "sampling.max_tokens=10",
    )
    run = run_local(compose(ov), engine=engine)
    out = read_output(run.path)
    assert [r["id"] for r in out] == [r["id"] for r in rows]
    assert all(r["label"] in ("physics", "biology", "chemistry") and r["label"] == r["text"] for r in out), out
    assert all(r["error"] is None and r["finish_reason"] == "stop" for r in out)
    assert all(0.0 < r["label_confidence"] <= 1.0 for r in out)
    # The prompt was built from the description and the names, and frozen in run.yaml.
    system = run.run["config"]["prompt"]["system"]
    assert system.startswith("Which field is this text from?") and "physics, biology, chemistry" in system
    assert run.run["config"]["sampling"]["structured_outputs"]["choice"] == ["physics", "biology", "chemistry"]
    # Without confidence there is no confidence column.
    ov = [*ov, "prompt.labels.confidence=false", f"output.dir={tmp_path / 'plain'}"]
    plain = read_output(run_local(compose(ov), engine=engine).path)
    assert "label_confidence" not in plain[0] and [r["label"] for r in plain] == [r["label"] for r in out]


def test_labels_conflicting_constraint_is_refused() -> None:
    with pytest.raises(ConfigError, match="prompt.labels.names sets the choice constraint"):
        compose(["prompt=labels", "sampling.structured_outputs.regex=x"])


@pytest.mark.parametrize("where", ["inline", "file"])
def test_json_schema_output_always_parses(tmp_path: Path, tiny_model_path: Path, engine: Any, where: str) -> None:
    schema = {
        "type": "object",
        "properties": {"topic": {"enum": ["dogs", "foxes"]}, "score": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["topic", "score"],
        "additionalProperties": False,
    }
    if where == "file":
        (tmp_path / "schema.json").write_text(json.dumps(schema))
        value = str(tmp_path / "schema.json")
    else:
        value = "'" + json.dumps(schema).replace("'", "\\'") + "'"
    corpus = tmp_path / "c.jsonl"
    rows = write_corpus(corpus, 8, seed=22)
    ov = overrides(tiny_model_path, corpus, tmp_path / "run", f"sampling.structured_outputs.json={value}")
    out = read_output(run_local(compose([*ov, "sampling.max_tokens=40"]), engine=engine).path)
    assert [r["id"] for r in out] == [r["id"] for r in rows]
    for r in out:
        parsed = json.loads(r["text"])  # compact JSON: no whitespace padding up to max_tokens
        assert set(parsed) == {"topic", "score"} and parsed["topic"] in ("dogs", "foxes") and 0 <= parsed["score"] <= 9
        assert r["finish_reason"] == "stop"


def test_seed_per_row_is_reproducible_and_independent_of_duplicates(
    tmp_path: Path, tiny_model_path: Path, engine: Any
) -> None:
    corpus = tmp_path / "c.jsonl"
    # 12 identical prompts: with one seed for all they are computed once; per row they differ.
    corpus.write_text("".join(json.dumps({"id": f"d{i}", "text": "quick brown fox"}) + "\n" for i in range(12)))
    hot = [
        "sampling=sample",
        "sampling.temperature=2.0",
        "sampling.repetition_penalty=2.0",
        "sampling.seed=11",
        "sampling.max_tokens=8",
    ]
    a = read_output(
        run_local(
            compose(overrides(tiny_model_path, corpus, tmp_path / "a", *hot, "sampling.seed_per_row=true")),
            engine=engine,
        ).path
    )
    b = read_output(
        run_local(
            compose(
                overrides(
                    tiny_model_path, corpus, tmp_path / "b", *hot, "sampling.seed_per_row=true", "sharding.num_shards=3"
                )
            ),
            engine=engine,
        ).path
    )
    same = read_output(run_local(compose(overrides(tiny_model_path, corpus, tmp_path / "c", *hot)), engine=engine).path)
    assert [r["text"] for r in a] == [r["text"] for r in b]  # same seeds per row, other shard layout
    assert len({r["text"] for r in a}) > 3  # rows sampled independently
    assert len({r["text"] for r in same}) == 1  # one shared seed: identical prompts, identical output
    with pytest.raises(ConfigError, match="seed_per_row=true needs sampling.seed"):
        compose(["sampling.seed_per_row=true"])


def test_row_sampling_column_overrides_config(tmp_path: Path, tiny_model_path: Path, engine: Any) -> None:
    corpus = tmp_path / "c.jsonl"
    rows = [
        {"id": "a", "text": "hello world", "params": {"max_tokens": 2}},
        {"id": "b", "text": "lazy dog", "params": None},
        {"id": "c", "text": "quick fox", "params": {"max_tokens": 3, "stop": []}},
        {"id": "d", "text": "brown fox", "params": {"max_tokns": 3}},
    ]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ov = overrides(tiny_model_path, corpus, tmp_path / "run", "input.sampling_column=params")
    out = read_output(run_local(compose(ov), engine=engine).path)
    assert [r["output_tokens"] for r in out[:3]] == [2, 6, 3]
    assert out[3]["error"]["kind"] == "sampling" and "max_tokns" in out[3]["error"]["message"]
    assert out[3]["error"]["message"].startswith("row 3:")


@pytest.mark.parametrize(("fmt", "files"), [("parquet", 4), ("jsonl", 4), ("hf", 4)])
def test_output_split_into_files_of_at_most_n_rows(
    tmp_path: Path, tiny_model_path: Path, engine: Any, fmt: str, files: int
) -> None:
    corpus = tmp_path / "c.jsonl"
    rows = write_corpus(corpus, 70, seed=23)
    ov = overrides(
        tiny_model_path,
        corpus,
        tmp_path / "run",
        f"output.format={fmt}",
        "output.max_rows_per_file=20",
        "sharding.num_shards=3",
    )
    run = run_local(compose(ov), engine=engine)
    out = read_output(run.path)
    assert_exactly_once(out, rows)
    stats = read_json(run.stats_json)
    assert stats["output"] == "output" and stats["rows"] == 70
    folder = run.path / "output"
    if fmt == "hf":
        ds = datasets.load_from_disk(str(folder))
        assert ds.num_rows == 70 and len(ds.cache_files) == files
        assert ds.features["error"]["kind"].dtype == "string"
        return
    names = sorted(p.name for p in folder.iterdir())
    assert names == [f"output-{i:05d}-of-{files:05d}.{fmt}" for i in range(files)] == stats["files"]
    counts = [
        pq.read_metadata(folder / n).num_rows if fmt == "parquet" else len((folder / n).read_text().splitlines())
        for n in names
    ]
    assert counts == [20, 20, 20, 10]


def test_hf_dataset_output_loads_with_load_from_disk(tmp_path: Path, tiny_model_path: Path, engine: Any) -> None:
    corpus = tmp_path / "c.jsonl"
    rows = write_corpus(corpus, 25, seed=24)
    ov = overrides(tiny_model_path, corpus, tmp_path / "run", "output.format=hf", "input.columns=[text]")
    run = run_local(compose(ov), engine=engine)
    ds = datasets.load_from_disk(str(run.path / "output"))
    assert ds.column_names[:3] == ["row", "id", "text"] and "input" in ds.column_names
    assert [r["input"]["text"] for r in ds] == [r["text"] for r in rows]
    assert_exactly_once(ds.to_list(), rows)
    assert not list(run.path.glob(".tmp-*"))  # staging and the conversion cache are gone
    run_local(compose(ov), engine=None)  # a finished hf output counts as complete: nothing to do


def _fake_hub_dataset(cache: Path, repo: str, rows: list[dict]) -> None:
    """A dataset in the Hugging Face hub cache layout, as `huggingface-cli download` leaves it."""
    folder = cache / f"datasets--{repo.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    data = folder / "snapshots" / commit / "data"
    data.mkdir(parents=True)
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(rows[:10]), data / "train-00000-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(rows[10:]), data / "train-00001-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:3]), data / "test-00000-of-00001.parquet")


def test_hub_dataset_name_from_local_cache(
    tmp_path: Path, tiny_model_path: Path, engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    rows = write_corpus(tmp_path / "unused.jsonl", 16, seed=25)
    _fake_hub_dataset(tmp_path / "hub", "acme/abstracts", rows)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)

    def hub(name: str, out: str, *extra: str) -> list[str]:
        ov = overrides(tiny_model_path, Path("unused"), tmp_path / out, *extra)
        return [f"input.path={name}", *(o for o in ov if not o.startswith("input.path"))]

    run = run_local(compose(hub("acme/abstracts", "run")), engine=engine)
    assert_exactly_once(read_output(run.path), rows)
    assert run.run["config"]["input"]["path"] == "acme/abstracts"
    assert "0123456789abcdef" in json.dumps(run.run["input"])  # the snapshot revision is on record
    test_split = run_local(compose(hub("hf://datasets/acme/abstracts", "t", "input.split=test")), engine=engine)
    assert [r["id"] for r in read_output(test_split.path)] == [r["id"] for r in rows[:3]]
    with pytest.raises(InputError, match=r"no split 'dev' \(splits: train, test\); set input.split"):
        run_local(compose(hub("acme/abstracts", "d", "input.split=dev")), engine=engine)
    missing = r"acme/missing: no such local file.*could not be fetched.*download --repo-type dataset acme/missing"
    with pytest.raises(InputError, match=missing):
        run_local(compose(hub("acme/missing", "m")), engine=engine)


def test_reasoning_goes_to_its_own_column(tmp_path: Path, tiny_model_path: Path) -> None:
    """A reasoning parser splits the output: thinking into `reasoning`, the answer into `text`.

    The random tiny model never closes a thought by itself, so a regex makes it write one; the
    prompt ends with </think>, which tells vLLM the constraint applies from the first token."""
    from batchinfer.engine.vllm_engine import Engine

    corpus = tmp_path / "c.jsonl"
    rows = [{"id": f"r{i}", "text": t} for i, t in enumerate(["hello world </think>", "quick fox </think>"])]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ov = overrides(
        tiny_model_path,
        corpus,
        tmp_path / "run",
        "model.reasoning_parser=deepseek_r1",
        "sampling.structured_outputs.regex='<think>[a-z]{3,8}</think>(yes|no)'",
        "sampling.max_tokens=30",
    )
    cfg = compose(ov)
    eng = Engine(to_dict(cfg))
    try:
        run = run_local(cfg, engine=eng)
    finally:
        eng.close()
    out = read_output(run.path)
    assert [r["id"] for r in out] == ["r0", "r1"]
    for r in out:
        assert r["text"] in ("yes", "no") and 3 <= len(r["reasoning"]) <= 8 and r["reasoning"].isalpha(), r
        assert "<think>" not in r["text"] and math.isfinite(r["output_tokens"])
    assert run.run["output_schema"]["columns"]["reasoning"] == "string"


def test_ngram_speculative_decoding_keeps_greedy_outputs(tmp_path: Path, tiny_model_path: Path, engine: Any) -> None:
    """speculative=ngram is a throughput knob: same rows as without it, on its own engine."""
    from batchinfer.engine.vllm_engine import Engine, llm_kwargs

    corpus = tmp_path / "c.jsonl"
    rows = write_corpus(corpus, 24, seed=26)
    plain = read_output(run_local(compose(overrides(tiny_model_path, corpus, tmp_path / "plain")), engine=engine).path)
    cfg = compose(overrides(tiny_model_path, corpus, tmp_path / "spec", "speculative=ngram"))
    assert llm_kwargs(to_config(cfg))["speculative_config"]["method"] == "ngram"
    eng = Engine(to_dict(cfg))
    try:
        run = run_local(cfg, engine=eng)
    finally:
        eng.close()
    out = read_output(run.path)
    assert_exactly_once(out, rows)
    assert [(r["text"], r["output_tokens"]) for r in out] == [(r["text"], r["output_tokens"]) for r in plain]
    # Not in the fingerprint: a run may switch it on or off when resumed.
    from batchinfer.rundir.store import RunDir

    assert RunDir(tmp_path / "plain").run["fingerprint"] == run.run["fingerprint"]
