"""output.reuse and resume know a model by its files, not its path: the same folder holding other
weights reuses nothing and is refused on resume; a run directory prepared before identities were
recorded is never reused from (its answers cannot say which weights made them)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from support.corpus import read_output, write_rows
from support.fake_engine import FakeEngine, keyed

from batchinfer.config.compose import compose
from batchinfer.engine.stopflag import StopFlag
from batchinfer.engine.worker import ShardWorker
from batchinfer.errors import RunDirError
from batchinfer.launch.local import run_shards
from batchinfer.models import identity as ident
from batchinfer.rundir.merge import merge
from batchinfer.rundir.model_record import KEY
from batchinfer.rundir.prepare import prepare
from batchinfer.rundir.schema import REUSED_COLUMN
from batchinfer.rundir.store import RunDir

WEIGHTS = "model-00001-of-00001.safetensors"


def model_folder(tmp_path: Path, weights: bytes) -> Path:
    """A model folder at one fixed path: config.json and one weights file of these bytes."""
    d = tmp_path / "my-model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (d / WEIGHTS).write_bytes(weights)
    return d


def rows_of(n: int) -> list[dict[str, Any]]:
    """n rows with distinct texts."""
    return [{"id": f"doc-{i:03d}", "text": f"row {i} of the corpus"} for i in range(n)]


def overrides(tmp_path: Path, name: str, *extra: str) -> list[str]:
    corpus = write_rows(tmp_path / "corpus.jsonl", rows_of(8))
    return [
        f"input.path={corpus}",
        f"model.path={tmp_path / 'my-model'}",
        f"output.dir={tmp_path / name}",
        "input.id_column=id",
        "output.commit_every_rows=4",
        *extra,
    ]


def run_all(run: RunDir) -> FakeEngine:
    """Every shard of run on a fresh fake engine, merged; the engine (what reached it)."""
    eng = FakeEngine()
    run_shards(run, [s.index for s in run.shards()], engine=keyed(eng, run))
    merge(run)
    return eng


def test_same_path_other_weights_reuses_nothing(tmp_path: Path) -> None:
    model_folder(tmp_path, b"\x01" * 4096)
    first = prepare(compose(overrides(tmp_path, "first")))
    run_all(first)
    # a fine-tune saved to the same place: same names, same sizes, other bytes
    model_folder(tmp_path, b"\x02" * 4096)
    second = prepare(compose(overrides(tmp_path, "second", f"output.reuse={first.path}")))
    eng = run_all(second)
    assert len(eng.added) == 8
    assert not any(r[REUSED_COLUMN] for r in read_output(second.path))
    assert first.run[KEY]["files"][WEIGHTS]["size"] == 4096
    # the weights the first run had: every answer is reused
    model_folder(tmp_path, b"\x01" * 4096)
    third = prepare(compose(overrides(tmp_path, "third", f"output.reuse={first.path}")))
    assert len(run_all(third).added) == 0 and all(r[REUSED_COLUMN] for r in read_output(third.path))


def test_changed_model_folder_is_refused_on_reopen_resume_and_in_the_worker(tmp_path: Path) -> None:
    from batchinfer.launch.submit import resume

    model_folder(tmp_path, b"\x01" * 4096)
    run = prepare(compose(overrides(tmp_path, "run", "sharding.num_shards=2")))
    run_shards(run, [0], engine=keyed(FakeEngine(), run))
    model_folder(tmp_path, b"\x02" * 4096)
    with pytest.raises(RunDirError) as e:
        prepare(compose(overrides(tmp_path, "run", "sharding.num_shards=2")))
    assert f"the model folder {tmp_path / 'my-model'}" in str(e.value)
    assert f"{WEIGHTS} changed contents" in str(e.value)
    with pytest.raises(RunDirError, match=f"{WEIGHTS} changed contents"):
        resume(str(run.path), [], force=True, dry_run=True)
    eng = FakeEngine()
    worker = ShardWorker(RunDir(run.path), lambda: keyed(eng, run), StopFlag())
    with pytest.raises(RunDirError, match=f"{WEIGHTS} changed contents"):
        worker.run_shard(run.shards()[1])
    assert eng.added == [] and not run.shard_folder(1).is_done()
    (tmp_path / "my-model" / "extra.safetensors").write_bytes(b"x")
    with pytest.raises(RunDirError, match="extra.safetensors is new"):
        prepare(compose(overrides(tmp_path, "run", "sharding.num_shards=2")))


def test_a_run_prepared_before_identities_resumes_and_is_never_reused_from(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model_folder(tmp_path, b"\x01" * 4096)
    old = prepare(compose(overrides(tmp_path, "old", "sharding.num_shards=2")))
    record = old.run
    del record[KEY]  # as an earlier batchinfer wrote it
    old.write_run(record)
    run_shards(old, [0], engine=keyed(FakeEngine(), old))
    model_folder(tmp_path, b"\x02" * 4096)  # nothing recorded to compare with: it resumes as before
    resumed = prepare(compose(overrides(tmp_path, "old", "sharding.num_shards=2")))
    assert KEY not in resumed.run
    run_all(resumed)
    model_folder(tmp_path, b"\x01" * 4096)  # even the same path and the same files: unknown, not reused
    with caplog.at_level(logging.WARNING, logger="batchinfer"):
        new = prepare(compose(overrides(tmp_path, "new", f"output.reuse={old.path}")))
        eng = run_all(new)
    assert len(eng.added) == 8
    assert f"output.reuse: {old.path} was prepared before batchinfer recorded a model's files" in caplog.text


def test_identity_names_sizes_and_sampled_contents(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ident, "WHOLE_BYTES", 1000)
    monkeypatch.setattr(ident, "HEAD_BYTES", 100)
    monkeypatch.setattr(ident, "SAMPLE_BYTES", 10)
    d = tmp_path / "m"
    (d / "sub").mkdir(parents=True)
    (d / "config.json").write_text("{}")
    (d / "sub" / "pooling.json").write_text("{}")
    (d / ".cache").mkdir()
    (d / ".cache" / "lock").write_text("not the model's")
    (d / ".hidden").write_text("not the model's")
    big = bytearray(range(256)) * 40  # 10,240 bytes: sampled
    (d / "w.bin").write_bytes(big)
    (d / "sub" / "up").symlink_to(d)  # a link back up the tree is walked once
    one = ident.model_identity(d)
    assert [(f.name, f.size, f.whole) for f in one.files] == [
        ("config.json", 2, True),
        ("sub/pooling.json", 2, True),
        ("w.bin", 10240, False),
    ]
    assert ident.ModelIdentity.from_dict(one.to_dict()) == one
    step = (10240 - 100 - 10) // ident.SAMPLES
    big[100 + 5 * step] ^= 0xFF  # a byte inside a sampled block
    (d / "w.bin").write_bytes(big)
    two = ident.model_identity(d)
    assert two.digest != one.digest
    assert one.changes(two) == [
        f"w.bin changed contents (sha256 {one.files[2].sha256[:12]} -> {two.files[2].sha256[:12]})"
    ]
    (d / "config.json").write_text("{} ")
    assert two.changes(ident.model_identity(d)) == ["config.json changed size (2 -> 3 bytes)"]


def small_sampling(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampling of files over 1,000 bytes (as of weight shards over 16 MiB), at test scale."""
    monkeypatch.setattr(ident, "WHOLE_BYTES", 1000)
    monkeypatch.setattr(ident, "HEAD_BYTES", 100)
    monkeypatch.setattr(ident, "SAMPLE_BYTES", 10)


def between_blocks(size: int) -> int:
    """A byte of a sampled file that no sampled block covers (inside neither head nor a block)."""
    step = (size - ident.HEAD_BYTES - ident.SAMPLE_BYTES) // ident.SAMPLES
    return ident.HEAD_BYTES + 5 * step + ident.SAMPLE_BYTES + 1


def test_full_identity_sees_a_same_size_change_the_sampled_one_cannot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fine-tune rewriting a few tensors of a large shard in place, the rest frozen: the sampled
    identity (the default) does not see it, as docs/redo-reuse.md says; model.identity=full does."""
    small_sampling(monkeypatch)
    weights = bytearray(range(256)) * 40  # 10,240 bytes: sampled
    d = model_folder(tmp_path, bytes(weights))
    sampled, full = ident.model_identity(d), ident.model_identity(d, ident.FULL)
    assert [f.whole for f in full.files] == [True, True] and full.mode == "full"
    assert ident.ModelIdentity.from_dict(full.to_dict()) == full and full.to_dict()["mode"] == "full"
    weights[between_blocks(len(weights))] ^= 0xFF
    model_folder(tmp_path, bytes(weights))
    assert ident.model_identity(d).digest == sampled.digest  # the default's documented blind spot
    now = ident.model_identity(d, ident.FULL)
    assert now.digest != full.digest
    assert full.changes(now) == [
        f"{WEIGHTS} changed contents (sha256 {full.files[1].sha256[:12]} -> {now.files[1].sha256[:12]})"
    ]


def test_model_identity_full_reuses_nothing_and_refuses_resume_after_a_same_size_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from batchinfer.launch.submit import resume

    small_sampling(monkeypatch)
    weights = bytearray(range(256)) * 40
    model_folder(tmp_path, bytes(weights))
    first = prepare(compose(overrides(tmp_path, "first", "model.identity=full")))
    run_all(first)
    assert first.run[KEY]["mode"] == "full" and first.run[KEY]["files"][WEIGHTS]["whole"] is True
    half = prepare(compose(overrides(tmp_path, "half", "model.identity=full", "sharding.num_shards=2")))
    run_shards(half, [0], engine=keyed(FakeEngine(), half))
    weights[between_blocks(len(weights))] ^= 0xFF  # the fine-tune in place
    model_folder(tmp_path, bytes(weights))
    second = prepare(compose(overrides(tmp_path, "second", "model.identity=full", f"output.reuse={first.path}")))
    assert len(run_all(second).added) == 8 and not any(r[REUSED_COLUMN] for r in read_output(second.path))
    with pytest.raises(RunDirError, match=f"{WEIGHTS} changed contents"):
        resume(str(half.path), [], force=True, dry_run=True)
    with pytest.raises(RunDirError, match=f"{WEIGHTS} changed contents"):  # reopened: checked as recorded (full)
        prepare(compose(overrides(tmp_path, "half", "sharding.num_shards=2")))


def test_model_identity_takes_sampled_or_full(tmp_path: Path) -> None:
    from batchinfer.config.checks import validate
    from batchinfer.errors import ConfigError

    model_folder(tmp_path, b"\x01" * 10)
    with pytest.raises(ConfigError, match=r"model.identity='all' is not one of: sampled, full"):
        validate(compose(overrides(tmp_path, "x", "model.identity=all")))
