"""The config's home on disk and in Hydra: the packaged conf/ folder and the schema registered in
Hydra's ConfigStore, so that YAML in conf/ is validated against it."""

from __future__ import annotations

from pathlib import Path

from batchinfer.config.schema import Config


def conf_dir() -> Path:
    """The packaged conf/ (batchinfer.conf in the wheel; the repo's conf/ in a checkout)."""
    try:
        import batchinfer.conf as packaged

        return Path(packaged.__file__).resolve().parent
    except ImportError:  # a checkout on PYTHONPATH, batchinfer not installed (or installed elsewhere)
        return Path(__file__).resolve().parents[2] / "conf"


def register_configs() -> None:
    """Register the schemas so YAML in conf/ is validated against them."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="schema", node=Config)
