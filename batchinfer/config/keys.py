"""Keys of a composed config that the schema does not have (a `+key` typo passes Hydra), named with
the keys of their section, the closest first."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from batchinfer.config.schema import Config


def schema_keys(key: str) -> tuple[str, list[str]]:
    """(section, its keys) for a dotted key: the schema's keys beside the key's last part."""
    import dataclasses
    import typing

    cls: Any = Config
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        hints = typing.get_type_hints(cls)
        sub = hints.get(part)
        sub = next((a for a in typing.get_args(sub) if dataclasses.is_dataclass(a)), sub)
        if not dataclasses.is_dataclass(sub):
            return ".".join(parts[: i + 1]), []
        cls = sub
    return ".".join(parts[:-1]), [f.name for f in dataclasses.fields(cls)]


def unknown_key_message(key: str) -> str:
    """One line for a key the schema does not have: the keys of its section, the closest first."""
    import difflib

    section, names = schema_keys(key)
    while not names and "." in key:  # below a key that is no section: that key is the unknown one
        key = key.rsplit(".", 1)[0]
        section, names = schema_keys(key)
    last = key.rsplit(".", 1)[-1]
    close = [c for c in difflib.get_close_matches(last, names, n=2) if c != last][:1]  # never the key itself
    hint = f" (did you mean {section + '.' if section else ''}{close[0]}?)" if close else ""
    where = f"{section} keys are" if section else "top-level keys are"
    return f"{key} is not a key{hint}; {where}: {', '.join(names)}"


def unknown_keys(cfg: DictConfig) -> list[str]:
    """Keys of a composed config that its schema does not have (a `+key` typo passes Hydra)."""
    found: list[str] = []

    def walk(node: Any, prefix: str) -> None:
        _, names = schema_keys(f"{prefix}x" if prefix else "x")
        if not names:
            return  # a free-form dict (cluster.env, engine_kwargs, ...): any key
        for k in node.keys():
            key = f"{prefix}{k}"
            if k not in names:
                found.append(key)
            elif isinstance(node.get(k), DictConfig):
                walk(node.get(k), f"{key}.")

    walk(cfg, "")
    return found
