"""output.reuse while an earlier run's shard is being sealed by another process: the index is built
from one consistent view of each shard (every committed row once), and an answer whose part the seal
removed is read from the compacted file. The sealer is a real second process; this one is held at
a hook between listing the shard's files and reading them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.corpus import write_rows
from support.fake_engine import FakeEngine, keyed
from support.runs import fake_model_dir

from batchinfer.config.compose import compose
from batchinfer.launch.local import run_shards
from batchinfer.rundir import reuse
from batchinfer.rundir.model_record import identity_digest
from batchinfer.rundir.prepare import prepare
from batchinfer.rundir.schema import DIGEST_COLUMN
from batchinfer.rundir.shard_folder import ShardFolder
from batchinfer.rundir.store import RunDir

SEALER = """
import sys
from batchinfer.locks import ShardLock, configured_mode
from batchinfer.rundir.store import RunDir
run = RunDir(sys.argv[1])
folder = run.shard_folder(1)
with ShardLock(folder.path, mode=configured_mode(run.path)):
    print(folder.finish({"shard": 1})["compacted"])
"""


def seal_in_another_process(run: RunDir) -> None:
    """Seal shard 1 of run in a second process, under its shard lock, and wait for it."""
    done = subprocess.run([sys.executable, "-c", SEALER, str(run.path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [f"rows.{run.part_format}"]


def unsealed_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> RunDir:
    """A run of 16 rows in 2 shards: shard 0 sealed, shard 1 all committed in several parts, not sealed
    (as a worker leaves it the moment before its seal)."""
    rows = [{"id": f"doc-{i:03d}", "text": f"row {i} of the corpus"} for i in range(16)]
    corpus = write_rows(tmp_path / "corpus.jsonl", rows)
    run = prepare(
        compose(
            [
                f"input.path={corpus}",
                f"model.path={fake_model_dir(tmp_path)}",
                f"output.dir={tmp_path / 'earlier'}",
                "input.id_column=id",
                "output.commit_every_rows=2",
                "sharding.num_shards=2",
            ]
        )
    )
    run_shards(run, [0], engine=keyed(FakeEngine(), run))
    with monkeypatch.context() as m:
        m.setattr(ShardFolder, "finish", lambda self, done: done)  # shard 1's worker stops before its seal
        run_shards(run, [1], engine=keyed(FakeEngine(), run))
    folder = run.shard_folder(1)
    assert not folder.is_done() and len(folder.part_files()) >= 2
    return run


def committed_digests(run: RunDir) -> dict[str, dict[str, Any]]:
    """Each committed row's answer by its request digest."""
    out = {}
    for s in run.shards():
        for r in run.shard_folder(s.index).read_rows().to_pylist():
            out[r[DIGEST_COLUMN]] = r
    return out


def test_index_built_while_a_shard_is_sealed_has_every_row_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = unsealed_run(tmp_path, monkeypatch)
    parts = run.shard_folder(1).part_files()
    before = committed_digests(run)
    real_read = reuse.read_committed
    sealed: list[Path] = []

    def held(r: RunDir, path: Path, columns: list[str]) -> Any:
        # the index listed shard 1's parts and is about to read the first: the seal happens now
        if path == parts[0] and not sealed:
            seal_in_another_process(run)
            sealed.append(path)
        return real_read(r, path, columns)

    monkeypatch.setattr(reuse, "read_committed", held)
    index = reuse.ReuseIndex([str(run.path)], run.schema.names, identity_digest(run.run))
    assert sealed and not any(p.exists() for p in parts)  # the seal removed the parts listed
    assert sorted(d.decode() for d in index.digests) == sorted(before)  # every committed row, once
    assert {index.files[n][-1].name for n in np.unique(index.file_of)} == {"rows.parquet"}
    for digest, row in before.items():
        got = index.answer(digest)
        assert got is not None and got["text"] == row["text"]


def test_an_answer_whose_part_a_seal_removed_is_read_from_the_compacted_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = unsealed_run(tmp_path, monkeypatch)
    index = reuse.ReuseIndex([str(run.path)], run.schema.names, identity_digest(run.run))
    before = committed_digests(run)
    assert {index.files[n][-1].name for n in np.unique(index.file_of)} == {
        "rows.parquet",
        *(p.name for p in run.shard_folder(1).part_files()),
    }
    seal_in_another_process(run)
    for digest, row in before.items():
        got = index.answer(digest)
        assert got is not None and got["text"] == row["text"] and got["output_tokens"] == row["output_tokens"]
