"""Turn an input row into chat messages or a raw prompt."""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any, Optional, Union

from batchinfer.errors import ConfigError

Messages = list[dict[str, str]]
Prompt = Union[str, Messages]

BRACES_HINT = "a literal { or } in a template is written {{ or }}"


class RowError(Exception):
    """A problem with one row: it becomes an error row, the shard goes on."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message


def load_template(prompt_cfg: dict[str, Any]) -> str:
    """The template text: prompt.template_file when set, else prompt.template."""
    path = prompt_cfg.get("template_file")
    if path:
        p = Path(path).expanduser()
        if not p.is_file():
            raise ConfigError(f"prompt.template_file {path}: no such file")
        return p.read_text(encoding="utf-8")
    return prompt_cfg["template"]


def template_fields(template: str) -> list[str]:
    """Top-level field names a str.format template uses; malformed braces raise ConfigError."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise ConfigError(f"prompt.template {template!r}: {e}; {BRACES_HINT}") from None
    names = []
    for _, name, _, _ in parsed:
        if name is None:
            continue
        if name == "" or name.isdigit():
            raise ConfigError(
                f"prompt.template {template!r}: positional field {{{name}}}; name a row field, e.g. {{text}}; {BRACES_HINT}"
            )
        top = name.split(".")[0].split("[")[0]
        if top not in names:
            names.append(top)
    return names


def check_fields(template: str, columns: list[str], source: str) -> None:
    """Every template field must be an input column; the error names the field."""
    for name in template_fields(template):
        if name not in columns:
            raise ConfigError(
                f"prompt.template uses {{{name}}} but {source} has no column {name!r} "
                f"(columns: {', '.join(columns)}); {BRACES_HINT}"
            )


class _Fields(dict):
    """A nested row field that templates may address as {meta.text} as well as {meta[text]}."""

    def __getattr__(self, name: str) -> Any:
        if name not in self:
            raise AttributeError(name)
        return self[name]


def _fields(value: Any) -> Any:
    if isinstance(value, dict):
        return _Fields({k: _fields(v) for k, v in value.items()})
    return value


class PromptBuilder:
    """Renders rows into prompts with one template, system prompt and mode."""

    def __init__(self, prompt_cfg: dict[str, Any]):
        self.template = load_template(prompt_cfg)
        self.fields = template_fields(self.template)
        self.system: Optional[str] = prompt_cfg.get("system")
        self.mode: str = prompt_cfg["mode"]

    def build(self, row: dict[str, Any]) -> Prompt:
        """Row -> prompt; a null or missing field raises RowError."""
        for name in self.fields:
            if name not in row:
                raise RowError("prompt", f"field {name!r} is missing; {BRACES_HINT}")
            if row[name] is None:
                raise RowError("prompt", f"field {name!r} is null")
        try:
            text = self.template.format(**{k: _fields(v) for k, v in row.items()})
        except (KeyError, AttributeError) as e:
            raise RowError("prompt", f"field {e.args[0]!r} is missing in this row; {BRACES_HINT}") from None
        except (IndexError, ValueError, TypeError) as e:
            raise RowError("prompt", f"prompt.template cannot be filled: {e!r}; {BRACES_HINT}") from None
        if not text.strip():
            raise RowError("prompt", "the prompt is empty")
        if self.mode == "raw":
            return text
        messages: Messages = []
        if self.system:
            messages.append({"role": "system", "content": self.system})
        messages.append({"role": "user", "content": text})
        return messages
