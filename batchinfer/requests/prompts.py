"""Turn an input row into chat messages or a raw prompt."""

from __future__ import annotations

import re
import string
from pathlib import Path
from typing import Any, Optional, Union

from batchinfer.config.schema import PromptConfig
from batchinfer.errors import ConfigError
from batchinfer.inputs.openai_batch import RAW_PROMPT

Messages = list[dict[str, str]]
Prompt = Union[str, Messages]

MESSAGES = "messages"  # a row with this field holds its own chat, used as it is
BRACES_HINT = "a literal { or } in a template is written {{ or }}"
MAX_FORMAT_WIDTH = 100_000  # characters one field's format spec may ask for


class RowError(Exception):
    """A problem with one row: it becomes an error row, the shard goes on."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message


def messages_note(prompt: PromptConfig, table: Any) -> Optional[str]:
    """What an input's `messages` column does to the config's prompt, for validate and the run's log
    (None when no row has one): as vLLM's LLM.chat takes a conversation, a row's own messages are
    its chat as they are, and the config's template, system prompt and examples do not apply to it."""
    if prompt.mode != "chat" or MESSAGES not in table.column_names:
        return None
    column = table.column(MESSAGES)  # an Arrow column: its nulls are the rows without messages
    with_messages = len(column) - column.null_count
    if not with_messages:
        return None
    unused = ["prompt.template_file" if prompt.template_file else "prompt.template"]
    unused += [k for k, v in (("prompt.system", prompt.system), ("prompt.examples", prompt.examples)) if v]
    rest = len(column) - with_messages
    return (
        f"{with_messages:,} of {len(column):,} rows have their own `{MESSAGES}`: each is sent as its own chat, "
        f"as it is, without {', '.join(unused)}" + (f" (those apply to the other {rest:,} rows)" if rest else "")
    )


def load_template(prompt: PromptConfig) -> str:
    """The template text: prompt.template_file when set, else prompt.template."""
    path = prompt.template_file
    if path:
        p = Path(path).expanduser()
        if not p.is_file():
            raise ConfigError(f"prompt.template_file {path}: no such file")
        try:
            return p.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            line = p.read_bytes()[: e.start].count(b"\n") + 1
            raise ConfigError(
                f"prompt.template_file {path}:{line}: invalid UTF-8 (byte {e.object[e.start]:#04x}); "
                "save the file as UTF-8"
            ) from None
    return prompt.template


def template_fields(template: str) -> list[str]:
    """Top-level field names a str.format template uses; malformed braces raise ConfigError."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise ConfigError(f"prompt.template {template!r}: {e}; {BRACES_HINT}") from None
    names = []
    for _, name, spec, _ in parsed:
        if name is None:
            continue
        _check_spec(template, name, spec or "")
        if name == "" or name.isdigit():
            raise ConfigError(
                f"prompt.template {template!r}: positional field {{{name}}}; name a row field, e.g. {{text}}; {BRACES_HINT}"
            )
        top = name.split(".")[0].split("[")[0]
        if top not in names:
            names.append(top)
    return names


def _check_spec(template: str, name: str, spec: str) -> None:
    """A format spec's width or precision past MAX_FORMAT_WIDTH (`{text:>1000000000000}` would ask
    for that many characters of memory in every row) raises ConfigError."""
    for number in re.findall(r"\d+", spec):
        if int(number) > MAX_FORMAT_WIDTH:
            raise ConfigError(
                f"prompt.template {{{name}:{spec}}}: a width or precision of {number} characters; "
                f"at most {MAX_FORMAT_WIDTH} (a prompt that long fits no model)"
            )


def check_fields(template: str, columns: list[str], source: str) -> None:
    """Every template field must be an input column (unless rows carry `messages`); the error names it."""
    if MESSAGES in columns or RAW_PROMPT in columns:
        return
    for name in template_fields(template):
        if name not in columns:
            raise ConfigError(
                f"prompt.template uses {{{name}}} but {source} has no column {name!r} "
                f"(columns: {', '.join(columns)}); {BRACES_HINT}"
            )


def apply_labels(c: dict[str, Any]) -> None:
    """prompt.labels -> a system prompt naming the labels, the choice constraint, logprobs for confidence
    (on the plain dict that prepare freezes into run.yaml)."""
    labels = c["prompt"]["labels"]
    if not labels["names"]:
        return
    if not c["prompt"]["system"]:
        description = labels["description"] or "Classify the text."
        c["prompt"]["system"] = (
            f"{description.strip()}\nAnswer with exactly one of these labels and nothing else: "
            + ", ".join(labels["names"])
        )
    c["sampling"]["structured_outputs"]["choice"] = list(labels["names"])
    if labels["confidence"]:
        c["sampling"]["logprobs"] = max(c["sampling"]["logprobs"] or 0, 0)


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


# Values a template field cannot take: str.format would paste Python's repr ([1, 2], {'a': 1}).
NOT_TEXT = {list: "a list", tuple: "a list", dict: "an object (dict)", _Fields: "an object (dict)", bytes: "bytes"}


class _RowFormatter(string.Formatter):
    """str.format over one row: a field that is missing, null, or not text, a number or a bool
    raises RowError naming it."""

    def get_field(self, field_name: str, args: Any, kwargs: Any) -> Any:
        # Dotted and [bracketed] parts are keys of an object (or a list's index), never attributes: {text.upper} or
        # {meta.keys} would paste a method's repr (with a memory address, different per process).
        import _string

        first, rest = _string.formatter_field_name_split(field_name)
        if first not in kwargs:
            raise RowError("prompt", f"field {field_name!r} is missing in this row; {BRACES_HINT}")
        value = kwargs[first]
        for _, key in rest:
            if isinstance(value, (list, tuple)) and isinstance(key, int):  # {items[0]}
                if not -len(value) <= key < len(value):
                    raise RowError(
                        "prompt", f"field {field_name!r} is missing in this row (the list has {len(value)} items)"
                    )
                value = value[key]
                continue
            if not isinstance(value, dict):
                raise RowError(
                    "prompt",
                    f"field {field_name!r}: {key!r} is not a key of an object here (the value before it is "
                    f"{type(value).__name__}); dotted and [bracketed] parts name keys of an object field",
                )
            if key not in value:
                raise RowError("prompt", f"field {field_name!r} is missing in this row; {BRACES_HINT}")
            value = value[key]
        if value is None:
            raise RowError("prompt", f"field {field_name!r} is null or missing")
        if type(value) in NOT_TEXT:
            raise RowError(
                "prompt",
                f"field {field_name!r} is {NOT_TEXT[type(value)]}, not a string, number or bool; "
                f"to put JSON in a prompt, write it into a string column first (json.dumps)",
            )
        return value, first


_FORMATTER = _RowFormatter()


class PromptBuilder:
    """Renders rows into prompts: template, system prompt, few-shot examples, chat or raw."""

    def __init__(self, prompt: PromptConfig):
        self.template = load_template(prompt)
        self.fields = template_fields(self.template)
        self.system: Optional[str] = prompt.system
        self.mode: str = prompt.mode
        self.examples: list[dict[str, Any]] = list(prompt.examples or [])
        for i, ex in enumerate(self.examples):
            missing = [f for f in [*self.fields, "answer"] if f not in ex]
            if missing:
                raise ConfigError(
                    f"prompt.examples[{i}] lacks {', '.join(missing)}: each example needs the template's fields and an answer"
                )

    def build(self, row: dict[str, Any]) -> Prompt:
        """Row -> prompt; a row's own `messages` list is used as it is; a bad field raises RowError."""
        if self.mode == "chat" and row.get(MESSAGES) is not None:
            return self._row_messages(row[MESSAGES])
        if row.get(RAW_PROMPT) is not None:  # an OpenAI /v1/completions request
            return str(row[RAW_PROMPT])
        text = self.fill(self.template, row)
        if self.mode == "raw":
            return text
        messages: Messages = []
        if self.system:
            messages.append({"role": "system", "content": self.system})
        for ex in self.examples:
            messages.append({"role": "user", "content": self.fill(self.template, ex)})
            messages.append({"role": "assistant", "content": ex["answer"]})
        messages.append({"role": "user", "content": text})
        return messages

    def fixed_turns(self) -> Messages:
        """The config's own chat turns (system prompt, examples) before a placeholder user turn."""
        messages: Messages = [{"role": "system", "content": self.system}] if self.system else []
        for ex in self.examples:
            messages.append({"role": "user", "content": self.fill(self.template, ex)})
            messages.append({"role": "assistant", "content": ex["answer"]})
        return [*messages, {"role": "user", "content": "x"}]

    def fill(self, template: str, row: dict[str, Any]) -> str:
        """str.format the template over a row's fields (strings, numbers, bools); errors name the field."""
        try:
            text = _FORMATTER.vformat(template, (), {k: _fields(v) for k, v in row.items()})
        except (IndexError, ValueError, TypeError, OverflowError, MemoryError) as e:  # e.g. a spec the value refuses
            raise RowError("prompt", f"prompt.template cannot be filled: {e!r}; {BRACES_HINT}") from None
        if not text.strip():
            blank = [n for n in template_fields(template) if isinstance(row.get(n), str) and not row[n].strip()]
            raise RowError("prompt", "the prompt is empty" + (f" (field {blank[0]!r} is blank)" if blank else ""))
        return text

    def _row_messages(self, messages: Any) -> Messages:
        if not isinstance(messages, list) or not messages:
            raise RowError("prompt", f"field {MESSAGES!r} must be a non-empty list of {{role, content}}")
        out = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise RowError("prompt", f"{MESSAGES}[{i}] needs a string role and content, got {m!r}")
            out.append({"role": m["role"], "content": m["content"]})
        return out
