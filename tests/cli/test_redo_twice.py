"""Two `batchinfer redo`s of one DIR at once, for real (the first in a subprocess stopped in a hook,
the second in this process), and a redo killed while it makes its pass folder: one wins, the other
is refused naming it, and neither removes what the other made."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.corpus import assert_own_output, read_output, write_corpus
from support.fake_slurm import cli
from support.procs import BlockedCli, run_cli
from support.runs import run_overrides
from support.standin import StandinEngine, standin_env

from batchinfer.config.compose import compose
from batchinfer.errors import RunDirError
from batchinfer.faults import ENV, IN_MERGE, PASS_FOLDER_MADE
from batchinfer.launch.local import run_local
from batchinfer.launch.redo import redo
from batchinfer.rundir.passes import pass_path, read_record
from batchinfer.rundir.store import RunDir

pytestmark = [pytest.mark.engine, pytest.mark.kill]

LENGTH = 'finish_reason == "length"'


@pytest.fixture
def done(tmp_path: Path, tiny_model_path: Path) -> dict[str, Any]:
    """A finished run of 60 rows at max_tokens=4 on the stand-in (some rows stop at `length`)."""
    corpus = tmp_path / "c.jsonl"
    rows = write_corpus(corpus, 60, seed=31)
    cfg = compose(run_overrides(tiny_model_path, corpus, tmp_path / "run", "sampling.max_tokens=4"))
    run = run_local(cfg, engine=StandinEngine(cfg))
    out = read_output(run.path)
    length = [r["row"] for r in out if r["finish_reason"] == "length"]
    assert 5 < len(length) < 50
    return {"run": run, "cfg": cfg, "rows": rows, "length": length, "output": run.output_path.read_bytes()}


def redo_killed_after_its_pass_folder(run: RunDir) -> tuple[Path, int]:
    """A redo SIGKILLed (the signal proven) right after it made passes/1, before pass.json: that
    folder and the killed process's pid."""
    res = run_cli(redo_args(run, "sampling.max_tokens=9"), env=dict(standin_env(), **{ENV: PASS_FOLDER_MADE}))
    assert res.returncode == -signal.SIGKILL, res.stderr[-3000:]
    return pass_path(run, 1), res.pid


def redo_args(run: RunDir, *overrides: str, where: str = LENGTH) -> list[str]:
    return ["redo", str(run.path), "--where", where, *overrides]


@contextlib.contextmanager
def first_redo_stopped_in(hook: str, run: RunDir) -> Iterator[BlockedCli]:
    """`redo --where LENGTH sampling.max_tokens=9` in a subprocess, stopped in redo's function hook."""
    with BlockedCli(f"batchinfer.launch.redo:{hook}", redo_args(run, "sampling.max_tokens=9"), standin_env()) as first:
        first.blocked()
        yield first


@pytest.mark.parametrize("how", ["go", "fail"])
def test_two_identical_redos_the_second_is_refused_naming_the_first(
    done: dict[str, Any], capsys: pytest.CaptureFixture, how: str
) -> None:
    run, cfg = done["run"], done["cfg"]
    path = pass_path(run, 1)
    # the first stops after writing pass.json, before its run.yaml: "a pass being made"
    with first_redo_stopped_in("write_selection", run) as first:
        assert (path / "pass.json").is_file() and not (path / "run.yaml").exists()
        # resume does not advise the same command (which would take the pass from its live maker)
        code, out, err = cli(["resume", str(run.path)], capsys)
        assert code != 0 and f"pid {first.pid}" in err and "run the same command again" not in err
        code, out, _ = cli(["status", str(run.path)], capsys)
        assert code == 0 and "pass 1: being made" in out
        with pytest.raises(RunDirError, match=rf"{re.escape(str(run.path))} is in use by host \S+ pid {first.pid}"):
            redo(str(run.path), LENGTH, ["sampling.max_tokens=9"], engine=StandinEngine(cfg))
        assert (path / "pass.json").is_file()  # the refused one touched nothing of it
        res = first.release(how)
    if how == "go":
        assert res.returncode == 0, res.stderr[-3000:]
        after = read_output(run.path)
        assert [r["row"] for r in after if r["pass"] == 1] == done["length"]
        assert [r["id"] for r in after] == [r["id"] for r in done["rows"]]
        for new, inp in zip(after, done["rows"], strict=True):
            assert_own_output(new, inp["text"])
    else:  # stopped by Ctrl-C while making it: its own half-made pass goes, nothing else
        assert res.returncode != 0
        assert not path.exists() and run.output_path.read_bytes() == done["output"]
        redo(str(run.path), LENGTH, ["sampling.max_tokens=9"], engine=StandinEngine(cfg))
        assert [r["row"] for r in read_output(run.path) if r["pass"] == 1] == done["length"]


def test_a_redo_does_not_select_from_a_view_another_pass_changes_before_it_makes_its_pass(
    done: dict[str, Any],
) -> None:
    run, cfg = done["run"], done["cfg"]
    # the first has selected its rows from the output as it is now, and not yet made its pass
    with first_redo_stopped_in("select_rows+", run) as first:
        assert not (run.path / "passes").exists() or not any((run.path / "passes").iterdir())
        # a second redo, of other settings, would make and merge a pass meanwhile that the first
        # one's selection never saw (and the first's pass would then undo its answers)
        with pytest.raises(RunDirError, match=rf"{re.escape(str(run.path))} is in use by host \S+ pid {first.pid}"):
            redo(str(run.path), LENGTH, ["sampling.max_tokens=40"], engine=StandinEngine(cfg))
        assert not pass_path(run, 1).exists()
        res = first.release()
    assert res.returncode == 0, res.stderr[-3000:]
    assert read_record(pass_path(run, 1)).overrides == ["sampling.max_tokens=9"]
    assert not pass_path(run, 2).exists()
    after = read_output(run.path)
    assert [r["row"] for r in after if r["pass"] == 1] == done["length"]
    # the second, run now, selects from the output the first's pass made
    still = [r["row"] for r in after if r["finish_reason"] == "length"]
    redo(str(run.path), LENGTH, ["sampling.max_tokens=40"], engine=StandinEngine(cfg))
    last = read_output(run.path)
    assert [r["row"] for r in last if r["pass"] == 2] == still
    assert [r for r in last if r["row"] not in still] == [r for r in after if r["row"] not in still]


def test_a_redo_killed_between_its_pass_folder_and_pass_json_does_not_block_the_next(
    done: dict[str, Any], capsys: pytest.CaptureFixture
) -> None:
    run, cfg = done["run"], done["cfg"]
    path, pid = redo_killed_after_its_pass_folder(run)
    assert path.is_dir() and not (path / "pass.json").exists()  # the kill landed there
    assert run.output_path.read_bytes() == done["output"]
    redo(str(run.path), LENGTH, ["sampling.max_tokens=9"], engine=StandinEngine(cfg))
    assert "was left half made by a redo that was stopped" in capsys.readouterr().out
    assert read_record(path).overrides == ["sampling.max_tokens=9"]
    after = read_output(run.path)
    assert [r["row"] for r in after if r["pass"] == 1] == done["length"]
    assert json.loads(run.stats_json.read_text())["passes"]["1"] == len(done["length"])


def test_a_redo_killed_while_it_selects_leaves_a_half_made_pass_the_next_takes_over(
    done: dict[str, Any], capsys: pytest.CaptureFixture
) -> None:
    run, cfg = done["run"], done["cfg"]
    path = pass_path(run, 1)
    with first_redo_stopped_in("write_selection", run) as first:
        os.killpg(first.pid, signal.SIGKILL)
        assert first.proc.wait() == -signal.SIGKILL
    assert (path / "pass.json").is_file() and not (path / "selection.parquet").exists()  # killed there
    code, out, _ = cli(["status", str(run.path)], capsys)
    assert code == 0 and "pass 1: half made" in out and "the next redo takes it over" in out
    code, out, err = cli(["resume", str(run.path)], capsys)  # the maker is dead: the same command loses nothing
    assert code != 0 and "run the same command again" in err and "sampling.max_tokens=9" in err
    redo(str(run.path), LENGTH, ["sampling.max_tokens=9"], engine=StandinEngine(cfg))
    assert "was left half made by a redo that was stopped" in capsys.readouterr().out
    assert [r["row"] for r in read_output(run.path) if r["pass"] == 1] == done["length"]


def test_a_redo_killed_between_its_pass_merge_and_dirs_is_merged_by_resume(
    done: dict[str, Any], capsys: pytest.CaptureFixture
) -> None:
    run = done["run"]
    # the pass (one shard) merges first, then DIR (three shards): the second merge is DIR's
    res = run_cli(redo_args(run, "sampling.max_tokens=9"), env=dict(standin_env(), **{ENV: f"{IN_MERGE}:2"}))
    assert res.returncode == -signal.SIGKILL, res.stderr[-3000:]
    path = pass_path(run, 1)
    assert RunDir(path).stats_json.is_file() and RunDir(path).output_path.exists()  # the pass was merged,
    assert run.output_path.read_bytes() == done["output"]  # DIR not: killed in its merge
    code, out, err = cli(["resume", str(run.path)], capsys)
    assert code == 0 and "nothing to resume" not in out, err
    after = read_output(run.path)
    assert [r["row"] for r in after if r["pass"] == 1] == done["length"]
    assert json.loads(run.stats_json.read_text())["merged_passes"] == [1]


def test_a_killed_redos_pass_holding_a_users_file_is_refused_naming_it(
    done: dict[str, Any], capsys: pytest.CaptureFixture
) -> None:
    """Taking over a half-made pass removes only what a redo makes there, never a file put there since."""
    run, cfg = done["run"], done["cfg"]
    path, pid = redo_killed_after_its_pass_folder(run)
    (path / "my-notes.txt").write_text("precious")
    with pytest.raises(RunDirError) as e:
        redo(str(run.path), LENGTH, ["sampling.max_tokens=9"], engine=StandinEngine(cfg))
    assert f"{path} was left half made by batchinfer redo (host " in str(e.value)
    assert f"pid {pid}" in str(e.value) and "it holds my-notes.txt" in str(e.value)
    assert (path / "my-notes.txt").read_text() == "precious" and run.output_path.read_bytes() == done["output"]
    (path / "my-notes.txt").unlink()
    redo(str(run.path), LENGTH, ["sampling.max_tokens=9"], engine=StandinEngine(cfg))
    assert [r["row"] for r in read_output(run.path) if r["pass"] == 1] == done["length"]


def test_a_symlink_planted_at_passes_is_refused_never_followed(
    done: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run, cfg = done["run"], done["cfg"]
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("keep")
    (run.path / "passes").symlink_to(victim, target_is_directory=True)
    code, _, err = cli(redo_args(run, "sampling.max_tokens=9"), capsys)
    assert code == 2 and "Traceback" not in err, err[-3000:]
    assert f"{run.path / 'passes'} is a symlink (to {victim}); batchinfer makes nothing through a symlink" in err
    assert sorted(p.name for p in victim.iterdir()) == ["keep"] and run.output_path.read_bytes() == done["output"]
    (run.path / "passes").unlink()  # what the refusal says
    redo(str(run.path), LENGTH, ["sampling.max_tokens=9"], engine=StandinEngine(cfg))
    assert [r["row"] for r in read_output(run.path) if r["pass"] == 1] == done["length"]
