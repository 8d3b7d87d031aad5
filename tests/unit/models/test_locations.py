"""Model locations: a hub name pinned to the revision in the local cache, or refused with the download command."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchinfer.errors import ConfigError


def test_hub_name_pinned_to_cached_revision(tmp_path: Path, monkeypatch) -> None:
    from batchinfer.models.locations import resolve_model

    snap = tmp_path / "hub" / "models--org--tiny" / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_model("org/tiny", None) == ("org/tiny", "a" * 40)
    with pytest.raises(
        ConfigError, match=r"org/missing: not in the local Hugging Face cache.*huggingface-cli download org/missing"
    ):
        resolve_model("org/missing", None)


def fake_hub(tmp_path: Path, monkeypatch, repo: str, ref: str) -> Path:
    """A local Hugging Face cache in tmp_path/hub whose repo's refs/main holds ref (offline, env pointed at it)."""
    import huggingface_hub.constants as hc

    top = tmp_path / "hub" / f"models--{repo.replace('/', '--')}"
    (top / "snapshots").mkdir(parents=True)
    (top / "refs").mkdir()
    (top / "refs" / "main").write_text(ref)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return top


def outside_folder(tmp_path: Path) -> Path:
    """A model-looking folder outside the cache, the one a crafted cache points at."""
    out = tmp_path / "elsewhere" / "lora1"
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")
    (out / "adapter_config.json").write_text("{}")
    return out


def test_a_cached_ref_that_is_not_a_commit_hash_is_refused_naming_the_cache_folder(tmp_path: Path, monkeypatch) -> None:
    from batchinfer.models.locations import hub_snapshot, resolve_model

    outside_folder(tmp_path)
    top = fake_hub(tmp_path, monkeypatch, "org/escape", "../../../elsewhere/lora1")
    with pytest.raises(ConfigError) as got:
        hub_snapshot("org/escape", None, "model.lora.adapters.x")
    said = str(got.value)
    assert said.startswith(f"model.lora.adapters.x org/escape: the Hugging Face cache folder {top.resolve()} "), said
    assert (
        "refs/main names the snapshot '../../../elsewhere/lora1', not a commit hash (40 lowercase hex digits)" in said
    )
    assert "huggingface-cli download org/escape" in said
    with pytest.raises(ConfigError, match=r"^model.path org/escape: the Hugging Face cache folder .*not a commit hash"):
        resolve_model("org/escape", None)  # model.path goes through the same check


def test_a_snapshot_folder_symlinked_out_of_the_cache_is_refused(tmp_path: Path, monkeypatch) -> None:
    from batchinfer.models.locations import hub_snapshot

    out = outside_folder(tmp_path)
    top = fake_hub(tmp_path, monkeypatch, "org/linked", "c" * 40)
    (top / "snapshots" / ("c" * 40)).symlink_to(out, target_is_directory=True)
    with pytest.raises(ConfigError) as got:
        hub_snapshot("org/linked", None, "model.lora.adapters.x")
    said = str(got.value)
    assert f"its snapshot {'c' * 40} leads to {out.resolve()}, outside {top.resolve() / 'snapshots'}" in said, said


@pytest.mark.parametrize("tail", ["\n", "\r\n", " "])
def test_a_cached_ref_with_trailing_whitespace_is_refused_saying_so(tmp_path: Path, monkeypatch, tail: str) -> None:
    """L1: the hub library takes refs/main's text as it is; the refusal said "not in the local cache"."""
    from batchinfer.models.locations import hub_snapshot

    top = fake_hub(tmp_path, monkeypatch, "org/nl", "d" * 40 + tail)
    (top / "snapshots" / ("d" * 40)).mkdir()
    with pytest.raises(ConfigError) as got:
        hub_snapshot("org/nl", None, "model.path")
    said = str(got.value)
    assert f"refs/main names the snapshot {'d' * 40 + tail!r}, a commit hash followed by whitespace ({tail!r}" in said
    assert f"printf %s {'d' * 40} > {top.resolve() / 'refs' / 'main'}" in said and "not in the local" not in said


def test_an_upper_case_cached_ref_is_refused_asking_for_lower_case(tmp_path: Path, monkeypatch) -> None:
    """L2: an upper-case hash was said to be no commit hash "(40 hex digits)", which it is."""
    from batchinfer.models.locations import hub_snapshot

    top = fake_hub(tmp_path, monkeypatch, "org/up", "AB" * 20)
    (top / "snapshots" / ("ab" * 20)).mkdir()
    with pytest.raises(ConfigError) as got:
        hub_snapshot("org/up", None, "model.path")
    assert f"refs/main names the snapshot {'AB' * 20!r}, not a commit hash (40 lowercase hex digits" in str(got.value)
    assert "write it in lower case" in str(got.value)
