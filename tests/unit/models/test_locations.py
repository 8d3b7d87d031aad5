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
