"""The one home of folder ownership (ownership.py, issue 40): a command makes, recognises, adopts,
publishes and removes only folders it made; two real processes contend for one folder."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from support.procs import python_child

from batchinfer import ownership
from batchinfer.errors import FolderRefused
from batchinfer.locks.holder import pid_start
from batchinfer.ownership import (
    LOCK,
    MARK,
    Kind,
    Layout,
    State,
    claim,
    make_dirs,
    publish,
    read_mark,
    recognise,
    stage,
    sweep,
)

MODES = ["auto", "file"]
# What the test's commands make in their folders (all a failure or an adoption may remove).
MADE = ("plan.json", "run.yaml", "input", "x", "made-by-child.txt", ".tmp-*")
LAYOUT = Layout("test folder", MADE)

# A second process that claims a folder, makes a file in it, says so, and waits (a blocked hook).
HOLDER = """
import sys
from pathlib import Path
from batchinfer.ownership import Layout, claim
layout = Layout("test folder", ("made-by-child.txt",))
with claim(Path(sys.argv[1]), "holder-test", layout=layout, mode=sys.argv[2]) as c:
    (c.path / "made-by-child.txt").write_text("child")
    print("ready", flush=True)
    sys.stdin.readline()
"""


@contextmanager
def holder(folder: Path, mode: str) -> Iterator[subprocess.Popen]:
    """A live process holding a claim on folder (until killed or told to finish)."""
    proc = python_child(HOLDER, str(folder), mode)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def files(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): p.read_text() for p in d.rglob("*") if p.is_file()}


def test_a_new_folder_is_made_marked_with_its_maker_and_finished(tmp_path: Path) -> None:
    out = tmp_path / "a" / "b"
    with claim(out, "prepare", layout=LAYOUT) as c:
        assert c.fresh and c.made_dir and not c.adopted and not c.existing
        mark = read_mark(out)
        assert mark is not None and mark.state is State.MAKING and mark.command == "prepare"
        assert mark.maker.pid == os.getpid() and mark.maker.pid_start == pid_start(os.getpid())
        assert recognise(out).kind is Kind.MAKING  # its maker (this process) is alive
        (out / "plan.json").write_text("{}")
    found = recognise(out)
    assert found.kind is Kind.DONE and found.mark is not None and found.mark.command == "prepare"
    with claim(out, "prepare", layout=LAYOUT) as again:
        assert again.existing  # handed over as it is
    assert (out / "plan.json").read_text() == "{}"


def test_a_failure_removes_only_what_the_claim_made(tmp_path: Path) -> None:
    new = tmp_path / "new"
    with pytest.raises(RuntimeError), claim(new, "prepare", layout=LAYOUT) as c:
        (c.path / "input").mkdir()
        raise RuntimeError("bad input")
    assert not new.exists()  # it made the folder: gone whole
    users = tmp_path / "users-empty"
    users.mkdir()
    with pytest.raises(RuntimeError), claim(users, "prepare", layout=LAYOUT):
        (users / "x").write_text("x")
        raise RuntimeError("bad input")
    assert users.is_dir() and os.listdir(users) == []  # the user's folder stays, as it was
    done = tmp_path / "done"
    with claim(done, "prepare", layout=LAYOUT):
        (done / "run.yaml").write_text("x")
    with pytest.raises(RuntimeError), claim(done, "prepare", layout=LAYOUT):
        raise RuntimeError("refused later")
    assert (done / "run.yaml").read_text() == "x"  # an existing folder is never removed


@pytest.mark.parametrize("kind", ["file", "folder", "symlink"])
def test_a_folder_it_did_not_make_is_refused_and_left_alone(tmp_path: Path, kind: str) -> None:
    target = tmp_path / "precious"
    target.mkdir()
    (target / "mine.txt").write_text("keep me")
    out = {"file": tmp_path / "f.txt", "folder": target, "symlink": tmp_path / "link"}[kind]
    if kind == "file":
        out.write_text("a file")
    if kind == "symlink":
        out.symlink_to(target, target_is_directory=True)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(FolderRefused) as e, claim(out, "prepare-model", layout=LAYOUT, label="--out"):
        pytest.fail("claimed")
    message = str(e.value)
    assert "\n" not in message and f"--out {out}" in message
    if kind == "folder":
        assert "not empty and batchinfer did not make it (it holds mine.txt)" in message
    else:
        assert ("a symlink" if kind == "symlink" else "a file") + ", not a folder" in message
    assert sorted(p.name for p in tmp_path.rglob("*")) == before and (target / "mine.txt").read_text() == "keep me"


@pytest.mark.parametrize("mode", MODES)
def test_a_second_process_is_refused_naming_the_first_then_adopts_once_it_is_killed(tmp_path: Path, mode: str) -> None:
    out = tmp_path / "run"
    with holder(out, mode) as proc:
        before = files(out)
        with pytest.raises(FolderRefused) as e, claim(out, "prepare", layout=LAYOUT, mode=mode):
            pytest.fail("two holders")
        assert f"pid {proc.pid}" in str(e.value) and str(out) in str(e.value), str(e.value)
        assert "batchinfer holder-test" in str(e.value)
        assert files(out) == before  # untouched
        found = recognise(out)
        assert found.kind is Kind.MAKING and found.mark is not None and found.mark.maker.pid == proc.pid
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    found = recognise(out)
    assert found.kind is Kind.HALF_MADE and "no such process" in found.why
    with claim(out, "prepare", layout=LAYOUT, mode=mode) as c:
        assert c.adopted and c.found.mark is not None and c.found.mark.maker.pid == proc.pid
        c.clear()  # the dead maker's contents
        assert not (out / "made-by-child.txt").exists()
        (out / "plan.json").write_text("mine")
    assert recognise(out).kind is Kind.DONE and files(out)["plan.json"] == "mine"


@pytest.mark.parametrize("mode", MODES)
def test_a_finished_holder_hands_the_folder_over(tmp_path: Path, mode: str) -> None:
    out = tmp_path / "run"
    with holder(out, mode) as proc:
        assert proc.stdin is not None
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait() == 0
    with claim(out, "prepare", layout=LAYOUT, mode=mode) as c:
        assert c.existing and (out / "made-by-child.txt").read_text() == "child"


def test_the_lock_file_a_removed_folder_held_is_not_a_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A contender that opened the lock file just before its holder removed it (the folder goes)
    must not take the removed file's lock: flocked opens the name again."""
    from batchinfer.locks import filesystems

    (tmp_path / "d").mkdir()
    lock = tmp_path / "d" / LOCK
    real_open = os.open
    calls = []

    def open_then_holder_removes(path: object, flags: int, *args: object) -> int:
        fd = real_open(path, flags, *args)  # type: ignore[arg-type]
        if not calls:
            lock.unlink()  # the holder removes the file after our open, before our flock
        calls.append(path)
        return fd

    monkeypatch.setattr(filesystems.os, "open", open_then_holder_removes)
    fd = filesystems.flocked(lock)
    try:
        assert len(calls) == 2 and os.fstat(fd).st_ino == os.stat(lock).st_ino
    finally:
        os.close(fd)


def test_publish_renames_into_an_absent_name_and_keeps_what_is_there(tmp_path: Path) -> None:
    dest = tmp_path / "model"
    with stage(tmp_path, "model", "prepare-model") as s:
        (s.path / "config.json").write_text("ours")
        assert publish(s, dest)
    assert (dest / "config.json").read_text() == "ours" and recognise(dest).kind is Kind.DONE
    with stage(tmp_path, "model", "prepare-model") as s:  # another process published meanwhile
        (s.path / "config.json").write_text("second")
        assert not publish(s, dest)
    assert (dest / "config.json").read_text() == "ours"
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "x").write_text("keep")
    (tmp_path / "link").symlink_to(target, target_is_directory=True)
    with stage(tmp_path, "model", "prepare-model") as s:
        assert not publish(s, tmp_path / "link")  # never through a symlink
    assert files(target) == {"x": "keep"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "link", "model"]  # no staging left


def test_sweep_removes_only_dead_makers_staging(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    with stage(tmp_path, "model", "prepare-model") as live:
        gone = tmp_path / ".tmp-model-dead"
        gone.mkdir()
        rec = json.loads((live.path / MARK).read_text())
        rec["maker"].update(pid=pid, pid_start=None)
        (gone / MARK).write_text(json.dumps(rec))
        (gone / "part").write_text("x")
        sweep(tmp_path, "model")
        assert not gone.exists() and live.path.is_dir()


def test_the_api_is_documented() -> None:
    doc = ownership.__doc__ or ""
    for name in ("recognise", "claim", "hold", "stage", "publish", "sweep", "FolderRefused", MARK, LOCK):
        assert name in doc


def test_a_failure_removes_only_the_names_its_command_makes(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A file someone puts into the folder while the claim's command works is not the command's."""
    caplog.set_level(logging.INFO, logger="batchinfer")
    users = tmp_path / "users-empty"
    users.mkdir()
    with pytest.raises(RuntimeError), claim(users, "prepare", layout=LAYOUT):
        (users / "plan.json").write_text("{}")
        (users / "input").mkdir()
        (users / "my-notes.txt").write_text("written meanwhile")
        raise RuntimeError("bad input")
    assert files(users) == {"my-notes.txt": "written meanwhile"} and sorted(os.listdir(users)) == ["my-notes.txt"]
    assert f"removed from {users} what this batchinfer prepare made there: input, plan.json" in caplog.text
    new = tmp_path / "new"
    with pytest.raises(RuntimeError), claim(new, "prepare", layout=LAYOUT):
        (new / "plan.json").write_text("{}")
        (new / "my-notes.txt").write_text("written meanwhile")
        raise RuntimeError("bad input")
    assert files(new) == {"my-notes.txt": "written meanwhile"}  # the folder it made stays for that file


@pytest.mark.parametrize("mode", MODES)
def test_a_half_made_folder_holding_a_users_file_is_refused_naming_it(
    tmp_path: Path, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The reported loss: taking over a killed command's folder removed a file the user put there
    after the crash. Its maker (a real process) is killed, the user adds a file: refused, naming it."""
    caplog.set_level(logging.INFO, logger="batchinfer")
    out = tmp_path / "run"
    with holder(out, mode) as proc:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    (out / "my-notes.txt").write_text("precious")
    found = recognise(out, layout=LAYOUT)
    assert found.kind is Kind.HALF_MADE and found.strays == ("my-notes.txt",)
    before = files(out)
    with pytest.raises(FolderRefused) as e, claim(out, "prepare", layout=LAYOUT, mode=mode, label="output.dir"):
        pytest.fail("adopted a folder holding a user's file")
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"output.dir {out} was left half made by batchinfer holder-test")
    assert f"pid {proc.pid}" in message and "it holds my-notes.txt, which batchinfer holder-test never makes" in message
    assert f"move them out of {out}" in message
    assert files(out) == before and files(out)["my-notes.txt"] == "precious"
    (out / "my-notes.txt").unlink()  # moved away: now it is taken over, and the log says what went
    with claim(out, "prepare", layout=LAYOUT, mode=mode) as c:
        assert c.adopted
        c.clear()
    assert [n for n in os.listdir(out) if not n.startswith(".batchinfer-owner")] == []
    assert f"pid {proc.pid}" in caplog.text and "made there: made-by-child.txt" in caplog.text


def test_an_unmarked_folder_an_older_version_half_made_holds_only_its_names(tmp_path: Path) -> None:
    """A stray marker file of an older batchinfer does not make a user's folder its own."""

    def older(path: Path) -> Kind | None:
        return Kind.HALF_MADE if (path / "x").exists() else None

    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "x").write_text("")
    (theirs / "thesis.tex").write_text("years")
    found = recognise(theirs, legacy=older, layout=LAYOUT)
    assert found.kind is Kind.FOREIGN and found.why == "thesis.tex"
    with pytest.raises(FolderRefused, match=r"did not make it \(it holds thesis.tex\)"):
        with claim(theirs, "prepare", layout=LAYOUT, legacy=older):
            raise RuntimeError("bad input")
    assert files(theirs) == {"x": "", "thesis.tex": "years"}
    (theirs / "thesis.tex").unlink()
    assert recognise(theirs, legacy=older, layout=LAYOUT).kind is Kind.HALF_MADE  # an older one's indeed


def forged_mark(folder: Path, **maker: object) -> None:
    """A "making" mark of a maker this machine cannot judge (another host, or before a reboot)."""
    folder.mkdir()
    with stage(folder.parent, "forge", "prepare") as s:
        rec = json.loads((s.path / MARK).read_text())
    rec["maker"].update(maker)
    (folder / MARK).write_text(json.dumps(rec))
    (folder / "input").mkdir()


@pytest.mark.parametrize(
    "maker",
    [{"host": "login2", "pid": 4242, "slurm_job": None}, {"boot_id": "00000000-0000-0000-0000-000000000000"}],
    ids=["another-host", "before-a-reboot"],
)
def test_a_maker_that_cannot_be_checked_is_refused_with_the_way_out(tmp_path: Path, maker: dict) -> None:
    out = tmp_path / "run"
    forged_mark(out, **maker)
    found = recognise(out, layout=LAYOUT)
    assert found.kind is Kind.MAKING and found.judged is not None
    with pytest.raises(FolderRefused) as e, claim(out, "prepare", layout=LAYOUT, label="output.dir"):
        pytest.fail("taken from a maker that cannot be judged")
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"output.dir {out} is being made by batchinfer prepare (host ")
    assert f"which cannot be checked from here ({found.why})" in message
    assert f"if that process is gone, remove {out} by hand" in message
    assert sorted(os.listdir(out)) == [MARK, "input"]  # never taken over


def test_nothing_is_made_through_a_symlink_inside_the_folder_it_is_made_in(tmp_path: Path) -> None:
    """A link planted at DIR/passes would carry DIR/passes/1 out of DIR."""
    root = tmp_path / "run"
    root.mkdir()
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("keep")
    (root / "passes").symlink_to(victim, target_is_directory=True)
    with pytest.raises(FolderRefused) as e, claim(root / "passes" / "1", "redo", layout=LAYOUT, within=root):
        pytest.fail("made through the link")
    message = str(e.value)
    assert f"{root / 'passes'} is a symlink (to {victim})" in message and "remove the link" in message
    with pytest.raises(FolderRefused, match="is a symlink"):
        make_dirs(root / "passes" / "1" / "deeper", within=root)
    assert files(victim) == {"keep": "keep"} and sorted(os.listdir(victim)) == ["keep"]
    (root / "passes").unlink()
    with claim(root / "passes" / "1", "redo", layout=LAYOUT, within=root) as c:
        assert c.fresh and (root / "passes").is_dir() and not (root / "passes").is_symlink()
