"""The fingerprint covers what changes outputs (file contents, engine_kwargs, model.seed), files
are frozen into the run directory, and directories made before still reopen (issue 13)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support.corpus import write_corpus
from support.runs import fake_model_dir

from batchinfer.config.compose import compose
from batchinfer.config.fingerprint import changed_keys, legacy_fingerprint
from batchinfer.engine.vllm_engine import structured_kwargs
from batchinfer.errors import ConfigError, RunDirError
from batchinfer.requests.prompts import PromptBuilder
from batchinfer.rundir.prepare import prepare
from batchinfer.rundir.store import RunDir

NEW_KEYS = ("model.seed", "model.engine_kwargs")


def _overrides(tmp_path: Path, *extra: str, out: str = "run") -> list[str]:
    corpus = tmp_path / "c.jsonl"
    if not corpus.exists():
        write_corpus(corpus, 6)
    return [f"input.path={corpus}", f"model.path={fake_model_dir(tmp_path)}", f"output.dir={tmp_path / out}", *extra]


def _refused(ov: list[str], match: str) -> None:
    with pytest.raises(RunDirError, match=match):
        prepare(compose(ov))


def _rewrite_record(path: Path, edit: Any) -> None:
    """Edit run.yaml as an older version would have written it."""
    run = RunDir(path)
    record = run.run
    edit(record)
    run.write_run(record)


def test_template_file_is_frozen_and_its_contents_fingerprinted(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    Path("t.txt").write_text("Topic of: {text}\n")
    ov = _overrides(tmp_path, "prompt.template_file=t.txt")  # relative: to where prepare runs
    run = prepare(compose(ov))
    frozen = Path(run.run["config"]["prompt"]["template_file"])
    assert frozen.is_absolute() and frozen.parent == run.path.absolute() / "files" / "prompt.template_file"
    assert frozen.read_text() == "Topic of: {text}\n"
    assert run.run["files"]["prompt.template_file"]["source"] == str(tmp_path / "t.txt")
    assert run.run["fingerprint_keys"]["prompt.template_file"]["file"] == "t.txt"

    Path("t.txt").write_text("Summary of: {text}\n")
    _refused(ov, r"prompt.template_file contents \(sha256 [0-9a-f]{12} -> [0-9a-f]{12}, file t.txt\)")
    # A worker elsewhere reads the frozen bytes, never the user's (now edited, then deleted) file.
    Path("t.txt").unlink()
    monkeypatch.chdir(fake_model_dir(tmp_path))
    builder = PromptBuilder(RunDir(run.path).config.prompt)
    assert builder.build({"text": "x"})[-1]["content"] == "Topic of: x\n"
    # Same contents under another name: outputs cannot differ, the DIR reopens and still reads its copy.
    (tmp_path / "moved.txt").write_text("Topic of: {text}\n")
    reopened = prepare(compose([*ov, f"prompt.template_file={tmp_path / 'moved.txt'}", "output.commit_every_rows=7"]))
    assert reopened.run["config"]["prompt"]["template_file"] == str(frozen)
    assert reopened.run["config"]["output"]["commit_every_rows"] == 7
    _refused([*ov, "prompt.template_file=null"], r"prompt.template_file \(file t.txt \(sha256 [0-9a-f]{12}\) -> None\)")


def test_schema_file_is_frozen_and_its_contents_fingerprinted(tmp_path: Path) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))
    ov = _overrides(tmp_path, f"sampling.structured_outputs.json={schema}")
    run = prepare(compose(ov))
    so = run.run["config"]["sampling"]["structured_outputs"]
    assert so["json"].startswith(str(run.path.absolute() / "files"))
    schema.write_text(json.dumps({"type": "object", "properties": {"b": {"type": "string"}}}))
    _refused(ov, r"sampling.structured_outputs.json contents \(sha256")
    schema.unlink()
    assert structured_kwargs(so)["json"]["properties"] == {"a": {"type": "integer"}}  # the frozen copy
    # Inline schemas are compared as text, as before.
    inline = "'" + json.dumps({"type": "string"}) + "'"
    prepare(compose(_overrides(tmp_path, f"sampling.structured_outputs.json={inline}", out="inline")))
    _refused(
        _overrides(tmp_path, 'sampling.structured_outputs.json=\'{"type": "integer"}\'', out="inline"),
        r"sampling.structured_outputs.json \(",
    )


def test_unreadable_or_invalid_files_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"prompt.template_file nope.txt: cannot read it"):
        prepare(compose(_overrides(tmp_path, "prompt.template_file=nope.txt")))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match=r"sampling.structured_outputs.json .*bad.json: not valid JSON"):
        prepare(compose(_overrides(tmp_path, f"sampling.structured_outputs.json={bad}")))
    assert not (tmp_path / "run").exists()


def test_engine_kwargs_fingerprinted_except_throughput_keys(tmp_path: Path) -> None:
    ov = _overrides(
        tmp_path, "+model.engine_kwargs.tokenizer_mode=slow", "+model.engine_kwargs.kv_cache_memory_bytes=64000000"
    )
    run = prepare(compose(ov))
    assert run.run["fingerprint_keys"]["model.engine_kwargs"] == {"tokenizer_mode": "slow"}
    # Throughput only: accepted, and the new value is what the next task uses.
    ov2 = [
        *ov[:-1],
        "+model.engine_kwargs.kv_cache_memory_bytes=32000000",
        "+model.engine_kwargs.async_scheduling=true",
    ]
    assert prepare(compose(ov2)).run["config"]["model"]["engine_kwargs"]["kv_cache_memory_bytes"] == 32000000
    _refused(
        [*ov[:-2], "+model.engine_kwargs.tokenizer_mode=auto"],
        r"model.engine_kwargs.tokenizer_mode \('slow' -> 'auto'\)",
    )
    _refused(ov[:-2], r"model.engine_kwargs.tokenizer_mode \('slow' -> None\)")
    # speculative=ngram is a throughput knob that keeps greedy outputs: switched on when resumed
    spec = prepare(compose([*ov, "+model.engine_kwargs.speculative_config.method=ngram"]))
    assert spec.run["config"]["model"]["engine_kwargs"]["speculative_config"] == {"method": "ngram"}


def test_model_seed_is_fingerprinted(tmp_path: Path) -> None:
    prepare(compose(_overrides(tmp_path)))
    _refused(_overrides(tmp_path, "model.seed=5"), r"model.seed \(0 -> 5\)")


def test_run_dir_of_an_older_version_reopens(tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_text("Q: {text}")
    ov = _overrides(tmp_path, f"prompt.template_file={tmp_path / 't.txt'}")
    run = prepare(compose(ov))

    def as_before(record: dict[str, Any]) -> None:  # no new keys, paths as written, nothing frozen
        for key in NEW_KEYS:
            del record["fingerprint_keys"][key]
        record["fingerprint_keys"]["prompt.template_file"] = str(tmp_path / "t.txt")
        record["config"]["prompt"]["template_file"] = str(tmp_path / "t.txt")
        del record["files"]

    _rewrite_record(run.path, as_before)
    assert prepare(compose(ov)).path == run.path  # same config: accepted
    prepare(compose([*ov, "model.seed=9", "+model.engine_kwargs.tokenizer_mode=slow"]))  # it never compared these
    (tmp_path / "t.txt").write_text("Q: {text}!")  # nor the template's contents, only its path
    reopened = RunDir(prepare(compose(ov)).path)
    assert reopened.run["config"]["prompt"]["template_file"] == str(tmp_path / "t.txt")  # not frozen after the fact
    assert "model.seed" not in reopened.run["fingerprint_keys"]
    (tmp_path / "u.txt").write_text("Q: {text}!")
    _refused([*ov, f"prompt.template_file={tmp_path / 'u.txt'}"], r"prompt.template_file \('.*t.txt' -> file .*u.txt")
    _refused([*ov, "sampling.max_tokens=3"], r"sampling.max_tokens \(256 -> 3\)")  # keys it had still count


def test_default_dir_named_by_an_older_version_is_found(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    ov = [o for o in _overrides(tmp_path) if not o.startswith("output.dir=")]
    run = prepare(compose(ov))
    keys = run.run["fingerprint_keys"]
    old_name = run.path.parent / f"{run.path.name.rsplit('-', 1)[0]}-{legacy_fingerprint(keys)[:8]}"
    assert old_name != run.path
    run.path.rename(old_name)

    def as_before(record: dict[str, Any]) -> None:
        for key in NEW_KEYS:
            del record["fingerprint_keys"][key]

    _rewrite_record(old_name, as_before)
    assert prepare(compose(ov)).path == old_name


def test_changed_keys_rules() -> None:
    record = {"file": "t.txt", "sha256": "a" * 64}
    assert changed_keys({"k": record}, {"k": dict(record, file="/elsewhere/t.txt")}) == []
    assert changed_keys({"k": record}, {"k": dict(record, sha256="b" * 64)}) == ["k"]
    assert changed_keys({"k": "t.txt"}, {"k": record}) == []  # an older run.yaml: the path as written
    assert changed_keys({"k": "u.txt"}, {"k": record}) == ["k"]
    assert changed_keys({}, {"model.seed": 1, "model.engine_kwargs": {"x": 1}}) == []
    assert changed_keys({"model.seed": 0}, {"model.seed": 1}) == ["model.seed"]
    assert changed_keys({"d": {"a": 1, "b": {"c": 2}}}, {"d": {"a": 1, "b": {"c": 3}}}) == ["d.b.c"]


def test_resume_checks_the_frozen_files(tmp_path: Path) -> None:
    from batchinfer.launch.submit import apply_resource_overrides

    (tmp_path / "t.txt").write_text("Q: {text}")
    run = prepare(compose(_overrides(tmp_path, f"prompt.template_file={tmp_path / 't.txt'}")))
    (tmp_path / "t.txt").write_text("edited: {text}")  # resume reads DIR's copy, not this
    apply_resource_overrides(RunDir(run.path), ["cluster.time=30"])
    with pytest.raises(RunDirError, match="model.seed"):
        apply_resource_overrides(RunDir(run.path), ["model.seed=2"])
    with pytest.raises(RunDirError, match="prompt.template_file"):
        apply_resource_overrides(RunDir(run.path), [f"prompt.template_file={tmp_path / 't.txt'}"])


def test_task_keys_are_fingerprinted_and_generation_runs_keep_theirs(tmp_path: Path) -> None:
    plain = prepare(compose(_overrides(tmp_path)))
    assert not [k for k in plain.run["fingerprint_keys"] if k.startswith("task.")]  # as before tasks existed
    _refused(_overrides(tmp_path, "task=embed"), r"task.name \(None -> 'embed'\)")
    ov = _overrides(tmp_path, "task=embed", out="embed")
    (fake_model_dir(tmp_path) / "config.json").write_text('{"hidden_size": 384}')  # sizes the embedding column
    embed = prepare(compose(ov))
    assert embed.schema.field("embedding").type.list_size == 384
    keys = embed.run["fingerprint_keys"]
    assert keys["task.name"] == "embed" and keys["prompt.overlong"] == "truncate_right" and keys["prompt.mode"] == "raw"
    ov = _overrides(tmp_path, "task=embed", "task.dimensions=128", out="embed")
    (tmp_path / "fake-model" / "config.json").write_text('{"hidden_size": 384, "matryoshka_dimensions": [128]}')
    _refused(ov, r"task.dimensions \(None -> 128\)")
