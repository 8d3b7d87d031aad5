"""A tune owns its folder and fresh trial folders (issue 40): `tune --out T` never writes into a
folder of the user's, two tunes of one folder at once are refused naming the first (two real
processes), a later tune never reopens an earlier one's trial run directories, trials run without
output.reuse, and the tune job is submitted with --no-requeue. The trials are replaced by a fake
successive halving that records the trial folders it is given (no engine)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from support.fake_slurm import cli
from support.procs import python_child
from support.runs import model_overrides

from batchinfer.config.compose import compose
from batchinfer.errors import FolderRefused
from batchinfer.ownership import Kind, recognise
from batchinfer.tune import command
from batchinfer.tune.command import Options
from batchinfer.tune.halving import Outcome, Rung

TRIES = ["model.max_num_seqs=8", "defaults"]

CHILD = """
import json, sys
sys.path.insert(0, sys.argv[2])
from pathlib import Path
import test_tune_folder as t
from batchinfer.config.compose import compose
from batchinfer.tune import command

def blocked(settings, rungs, launch, budget, say=print):
    out = t.fake_halve(settings, rungs, launch, budget, say)
    print("tuning", flush=True)
    sys.stdin.readline()
    return out

command.halve = blocked
args = json.loads(sys.argv[1])
command.tune(compose(args["overrides"]), command.Options(**args["options"]))
print("tuned", flush=True)
"""

launched: list[Path] = []


def fake_halve(settings: list[Any], rungs: int, launch: Any, budget: float, say: Any = print) -> list[Outcome]:
    """Every setting launched once (its trial folder made, recorded), each measured at 48 tokens a second."""
    out = []
    for s in settings:
        trial = launch(s)
        launched.append(trial.folder)
        rung = Rung(0, 8, 90, 48, 1.0, output_lengths=[6] * 8, stopped_at_max_tokens=8)
        out.append(Outcome(s, 3.5, [rung]))
    return out


def corpus(tmp_path: Path, rows: int = 40) -> Path:
    path = tmp_path / "in.jsonl"
    path.write_text(
        "".join(json.dumps({"id": f"r{i}", "text": f"hello {i} " * (1 + i % 5)}) + "\n" for i in range(rows))
    )
    return path


def overrides(tmp_path: Path, model: Path) -> list[str]:
    return [f"input.path={corpus(tmp_path)}", "input.id_column=id", *model_overrides(model)]


def tune_in_a_child(tmp_path: Path, model: Path) -> tuple[Path, list[str], Any]:
    """A tune of TMP/T in another process, held once its folder is claimed (it said "tuning"):
    the folder, the overrides and the child (stdin releases it)."""
    out = tmp_path / "T"
    ov = overrides(tmp_path, model)
    args = {"overrides": ov, "options": {"overrides": [], "rows": 8, "tries": TRIES, "out": str(out)}}
    child = python_child(CHILD, json.dumps(args), str(Path(__file__).parent))
    assert child.stdout is not None and child.stdout.readline().strip() == "tuning", child.communicate()[1][-3000:]
    return out, ov, child


def test_tune_out_refuses_a_users_folder_and_writes_nothing_there(
    tmp_path: Path, tiny_model_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(command, "halve", fake_halve)
    mine = tmp_path / "mine"
    (mine / "rungs").mkdir(parents=True)
    (mine / "pilot.parquet").write_text("my own pilot")
    (mine / "tune.json").write_text("{}")  # another tool's file by that name
    (mine / "notes.md").write_text("notes")
    before = {str(p.relative_to(mine)): p.stat().st_mtime_ns for p in mine.rglob("*")}
    argv = ["tune", *overrides(tmp_path, tiny_model_path), "--rows", "8", "--out", str(mine)]
    code, _, err = cli([*argv, *[a for t in TRIES for a in ("--try", t)]], capsys)
    assert code == 2 and "Traceback" not in err, err[-3000:]
    assert f"tune --out {mine} is not empty and batchinfer did not make it (it holds notes.md" in err
    assert {str(p.relative_to(mine)): p.stat().st_mtime_ns for p in mine.rglob("*")} == before


def test_a_later_tune_never_reopens_an_earlier_ones_trials(
    tmp_path: Path, tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reported wrong winner: a second tune of the default folder with the settings in
    another order reopened trial 00's run directories, measured by the other setting."""
    monkeypatch.setattr(command, "halve", fake_halve)
    monkeypatch.chdir(tmp_path)
    launched.clear()
    cfg = compose(overrides(tmp_path, tiny_model_path))
    first = command.tune(cfg, Options([], rows=8, tries=TRIES))
    folder = Path(first["folder"])
    assert recognise(folder).kind is Kind.DONE and folder.parent == tmp_path / "runs"
    trials_of_first = list(launched)
    command.tune(cfg, Options([], rows=16, tries=list(reversed(TRIES))))
    trials_of_second = launched[len(trials_of_first) :]
    assert len(trials_of_second) == 2 and not set(trials_of_first) & set(trials_of_second)
    assert {t.parent for t in trials_of_first} != {t.parent for t in trials_of_second}
    for t in trials_of_first + trials_of_second:
        spec = json.loads((t / "spec.json").read_text())
        assert Path(spec["out"]).parent == t  # each trial's run directories under its own folder


def test_two_tunes_of_one_folder_at_once_the_second_is_refused_naming_the_first(
    tmp_path: Path, tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(command, "halve", fake_halve)
    out, ov, child = tune_in_a_child(tmp_path, tiny_model_path)
    try:
        before = {str(p.relative_to(out)): p.stat().st_mtime_ns for p in out.rglob("*")}
        with pytest.raises(FolderRefused) as e:
            command.tune(compose(ov), Options([], rows=8, tries=TRIES, out=str(out)))
        assert f"tune --out {out} is being made by batchinfer tune (host " in str(e.value)
        assert f"pid {child.pid}," in str(e.value)
        assert {str(p.relative_to(out)): p.stat().st_mtime_ns for p in out.rglob("*")} == before
        said, err = child.communicate("\n", timeout=300)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 0 and said.strip() == "tuned", err[-3000:]
    assert json.loads((out / "tune.json").read_text())["best"]["name"] is not None


def test_trials_run_without_output_reuse() -> None:
    from batchinfer.tune.trial import rung_overrides

    ov = rung_overrides(["output.reuse=[/runs/old]", "model.max_num_seqs=8"], "/t/rung-0.parquet", "/t/runs/rung-0")
    assert "output.reuse=[/runs/old]" not in ov and "output.reuse=null" in ov and "model.max_num_seqs=8" in ov


def test_the_tune_job_is_never_requeued() -> None:
    from submitit.slurm.slurm import _as_sbatch_flag

    from batchinfer.config.schema import ClusterConfig
    from batchinfer.tune.remote import job_parameters

    params = job_parameters(ClusterConfig(sbatch_extra={"requeue": True}), 10, "bi-tune-x")
    extra = params["additional_parameters"]
    assert extra.get("no_requeue") is True and "requeue" not in extra
    assert _as_sbatch_flag("no_requeue", True) == "#SBATCH --no-requeue"


def test_a_killed_tunes_folder_holding_a_users_file_is_refused_naming_it(
    tmp_path: Path, tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(command, "halve", fake_halve)
    out, ov, child = tune_in_a_child(tmp_path, tiny_model_path)
    child.kill()  # killed with its folder claimed, half made
    child.wait()
    (out / "my-notes.txt").write_text("precious")
    with pytest.raises(FolderRefused) as e:
        command.tune(compose(ov), Options([], rows=8, tries=TRIES, out=str(out)))
    assert str(e.value).startswith(f"tune --out {out} was left half made by batchinfer tune (host ")
    assert f"pid {child.pid}," in str(e.value) and "it holds my-notes.txt" in str(e.value)
    assert (out / "my-notes.txt").read_text() == "precious" and (out / "pilot.parquet").is_file()
    (out / "my-notes.txt").unlink()
    result = command.tune(compose(ov), Options([], rows=8, tries=TRIES, out=str(out)))
    assert result["best"]["name"] is not None and recognise(out).kind is Kind.DONE


def test_a_users_folder_with_files_of_a_tunes_names_is_not_an_older_tune(
    tmp_path: Path, tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reported loss: a tune.json of an older tune's keys beside the user's pilot.parquet made
    the folder "an older tune's", and the tune wrote over the user's file."""
    monkeypatch.setattr(command, "halve", fake_halve)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "tune.json").write_text('{"version": 1, "fingerprint": "x", "settings": [], "best": {}}')
    (mine / "pilot.parquet").write_text("my own pilot")
    ov = overrides(tmp_path, tiny_model_path)
    with pytest.raises(FolderRefused, match="is not empty and batchinfer did not make it"):
        command.tune(compose(ov), Options([], rows=8, tries=TRIES, out=str(mine)))
    assert (mine / "pilot.parquet").read_text() == "my own pilot" and sorted(os.listdir(mine)) == [
        "pilot.parquet",
        "tune.json",
    ]
    # a folder an older tune really made (a finished tune's, without the owner's mark) is still one
    older = tmp_path / "older"
    command.tune(compose(ov), Options([], rows=8, tries=TRIES, out=str(older)))
    for name in os.listdir(older):
        if name.startswith(".batchinfer-owner"):
            (older / name).unlink()
    assert command._older_tune(older) is Kind.DONE
    (older / "notes.md").write_text("mine")  # and with a name no tune makes: the user's
    assert command._older_tune(older) is None


def test_output_private_makes_the_tune_folder_private_whatever_the_umask(
    tmp_path: Path, tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """attack42 B15: the pilot (the user's input rows), the rungs and the trials' specs were 0644
    in a 0755 folder under output.private=user."""
    monkeypatch.setattr(command, "halve", fake_halve)
    out = tmp_path / "T"
    old = os.umask(0o022)
    try:
        command.tune(
            compose([*overrides(tmp_path, tiny_model_path), "output.private=user"]),
            Options([], rows=8, tries=TRIES, out=str(out)),
        )
    finally:
        os.umask(old)
    made = [out, *out.rglob("*")]
    assert (out / "pilot.parquet").is_file() and list(out.rglob("spec.json"))  # the files the attack found
    loose = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777) for p in made if p.stat().st_mode & 0o077}
    assert not loose, loose


def test_tune_records_marking_a_secrets_place_are_owner_only(
    tmp_path: Path, tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """attack42b K6: tune.json holds the tune's overrides with a secret's place marked, and was 0644."""
    monkeypatch.setattr(command, "halve", fake_halve)
    monkeypatch.setenv("HF_TOKEN", "hf_PLANTEDk6secret0123")
    out = tmp_path / "T"
    old = os.umask(0o022)
    try:
        ov = [*overrides(tmp_path, tiny_model_path), "+cluster.env.HF_TOKEN=hf_PLANTEDk6secret0123"]
        command.tune(compose(ov), Options(ov, rows=8, tries=TRIES, out=str(out)))
    finally:
        os.umask(old)
    assert "hf_PLANTEDk6secret0123" not in (out / "tune.md").read_text()
    text = (out / "tune.json").read_text()
    assert "+cluster.env.HF_TOKEN=${oc.env:HF_TOKEN}" in text and "hf_PLANTEDk6secret0123" not in text
    assert (out / "tune.json").stat().st_mode & 0o077 == 0, oct((out / "tune.json").stat().st_mode)
