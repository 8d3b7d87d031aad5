"""Slurm's commands faked by shell scripts on PATH, and batchinfer's main in this process (no cluster)."""

from __future__ import annotations

import os
import signal
import stat
from pathlib import Path
from typing import Any

import pytest

from batchinfer.cli import main
from support.corpus import write_corpus
from support.runs import fake_model_dir

# A fake sbatch's first line: counts its calls in <script>.count.
SUBMITTED = 'n=$(cat "$0.count" 2>/dev/null || echo 0); echo $((n + 1)) > "$0.count"; '


def fake_slurm_bin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """(The fake_bin fixture.) A folder first on PATH; fake(name, body) writes a shell script there. srun must exist for
    submitit; scontrol answers `show config` with MaxArraySize = 1001 unless replaced."""
    folder = tmp_path / "bin"
    folder.mkdir()
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")

    def fake(name: str, body: str) -> Path:
        path = folder / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
        return path

    fake("srun", "exit 0")
    fake("scontrol", 'echo "MaxArraySize            = 1001"')
    fake("squeue", "exit 0")
    fake("sacct", "exit 0")
    fake("scancel", f'echo "$@" >> "{folder}/scancel.calls"')
    fake.folder = folder  # type: ignore[attr-defined]
    return fake


def cli(args: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    """batchinfer's main in this process; its USR2 block is undone for the tests after it."""
    try:
        code = main(args)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR2})
    out, err = capsys.readouterr()
    return code, out, err


def overrides(tmp_path: Path, n: int, *extra: str) -> list[str]:
    """A Slurm run of n random rows on a fake model folder."""
    corpus = tmp_path / "c.jsonl"
    if not corpus.exists():
        write_corpus(corpus, n)
    return [
        f"input.path={corpus}",
        "input.id_column=id",
        f"model.path={fake_model_dir(tmp_path)}",
        f"output.dir={tmp_path}/run",
        "cluster=slurm",
        *extra,
    ]
