"""The one redaction: every record batchinfer writes (run.yaml, pass.json, jobs.jsonl, tune files,
trial specs, sbatch scripts) and every line it prints goes through here, so no command can forget it.

Secrets are found as secret scanners find them: by name (a word part token, secret, password,
pass, pwd, key, jwt, cookie, credential, webhook, auth, ...), by a URL's `user:password@`, and by
value (the value of a secret-named variable of this environment, or of a secret given in the
config). A value found by value is written as `${oc.env:NAME}`, a reference the task resolves
from its own environment; one found by name becomes `<redacted>`."""

from __future__ import annotations

import functools
import io
import json
import logging
import os
import re
import sys
from typing import Any, Optional, TextIO

import yaml

REDACTED = "<redacted>"

# Whole word parts only: `max_tokens`, `sort_keys`, `tokenizer`, `passes` and `keep` are not secrets.
SECRET_WORDS = frozenset(
    {
        "token",
        "key",
        "apikey",
        "secret",
        "secrets",
        "password",
        "passwords",
        "passwd",
        "pass",
        "pwd",
        "passphrase",
        "credential",
        "credentials",
        "auth",
        "authorization",
        "jwt",
        "cookie",
        "cookies",
        "webhook",
        "webhooks",
        "pat",
    }
)
# Environment variables written as one word (PGPASSWORD, HFTOKEN): a secret word at the end.
SECRET_SUFFIXES = ("token", "password", "passwd", "passphrase", "secret", "apikey", "credential", "credentials")
# Word parts of snake_case, kebab-case, dotted and camelCase names (HFToken -> HF, Token).
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")

# Redaction by value: values shorter than this are common words and numbers ("true", "main",
# "1234"), which would be struck out of every record; secret scanners and CI masks draw the line
# at 8 characters too (GitLab refuses to mask shorter ones). Shorter secrets are caught by name.
MIN_VALUE_LENGTH = 8
# Names with a secret word that hold no secret: the shell's working folders (pwd); and (for
# redaction by value) a secret's location (a socket, a file, a folder), which records name as paths.
NOT_SECRET_ENV = frozenset({"PWD", "OLDPWD"})
LOCATION_PARTS = frozenset({"path", "file", "dir", "sock", "socket", "home", "url_file"})

# Subtrees whose keys are the user's columns, not settings: few-shot examples, run.yaml's column summary.
ROW_DATA = ("prompt.examples", "output_schema.columns")

_URL_PASSWORD = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://[^\s:/@'\"]+):([^\s@/'\"]+)@")
# NAME=value as a shell line or an override writes it (+cluster.env.DB_PASS=x); $NAME values are references.
_ASSIGNMENT = re.compile(r"(?<![\w$.\-])([+~]{0,2}[A-Za-z_][\w.\-]*)=(\"[^\"]*\"|'[^']*'|[^\s;&|,)\]}]+)")
# --token VALUE, --api-key=VALUE: an option with a secret name and its argument.
_FLAG = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)(=|[ \t]+)(\"[^\"]*\"|'[^']*'|[^\s;&|]+)")
ENV_REF = re.compile(r"\$\{oc\.env:([A-Za-z_][A-Za-z0-9_]*)(?:,[^}]*)?\}")

# Secrets given in the config (cluster.env, cluster.env_inherit) of this process: name -> value.
_carried: dict[str, str] = {}


@functools.lru_cache(maxsize=4096)
def is_secret_name(name: str) -> bool:
    """Whether a config key, option or environment variable name looks like it holds a secret."""
    if name in NOT_SECRET_ENV:
        return False
    parts = _WORD.findall(str(name))
    if any(part.lower() in SECRET_WORDS for part in parts):
        return True
    return any(part.isupper() and part.lower().endswith(SECRET_SUFFIXES) for part in parts)


def has_url_password(value: Any) -> bool:
    """Whether a value holds a URL with a password (postgres://user:password@host/db)."""
    return isinstance(value, str) and _URL_PASSWORD.search(value) is not None


def is_secret_entry(name: str, value: Any) -> bool:
    """An environment entry (cluster.env) to keep out of files: a secret name or a URL's password."""
    return value is not None and (is_secret_name(name) or has_url_password(str(value)))


def env_ref(name: str) -> str:
    """How a record refers to a secret variable: an interpolation the task resolves."""
    return "${oc.env:" + name + "}"


def env_refs(text: str) -> list[str]:
    """The variables `${oc.env:NAME}` references in text name."""
    return ENV_REF.findall(text)


def resolve_refs(text: str) -> str:
    """`${oc.env:NAME}` references (what records hold of a secret) resolved from this environment
    where it has the variable: done only where the value is used (a task, an engine's environment)."""
    return ENV_REF.sub(lambda m: os.environ.get(m.group(1), m.group(0)), text)


def shell_refs(text: str) -> str:
    """`${oc.env:NAME}` references as the shell's `${NAME}`: a line of an sbatch script gets the
    value from the task's environment, never from the script."""
    return ENV_REF.sub(lambda m: "${" + m.group(1) + "}", text)


def carry(name: str, value: Any) -> None:
    """Remember a secret given in the config: its value is struck from every record of this process."""
    if value is not None and str(value) != REDACTED and not env_refs(str(value)):
        _carried[name] = str(value)


def carried() -> dict[str, str]:
    """The secrets given in the config of this process (name -> value), for a child's environment."""
    return dict(_carried)


def _holds_secret(name: str) -> bool:
    if not is_secret_name(name):
        return False
    return not any(p.lower() in LOCATION_PARTS for p in _WORD.findall(name)[-1:])


def secret_values() -> list[tuple[str, str]]:
    """(value, name) of every secret known here, longest value first: secret-named variables of this
    environment and secrets given in the config, values of MIN_VALUE_LENGTH characters or more."""
    found = {v: k for k, v in os.environ.items() if len(v) >= MIN_VALUE_LENGTH and _holds_secret(k)}
    found.update({v: k for k, v in _carried.items() if len(v) >= MIN_VALUE_LENGTH})
    return sorted(found.items(), key=lambda kv: -len(kv[0]))


def _unquoted(value: str) -> str:
    return value[1:-1] if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"" else value


def _named_value(value: str) -> bool:
    """A value that is a secret to strike: not a reference ($NAME, ${oc.env:NAME}) nor already struck."""
    inner = _unquoted(value)
    return bool(inner) and not inner.startswith("$") and REDACTED not in inner


def redact_text(text: str, values: Optional[list[tuple[str, str]]] = None) -> str:
    """A line or a value with its secrets struck: URL passwords, known secret values (as references
    to their variable), and the values of secret-named assignments and options."""
    if not text:
        return text
    text = _URL_PASSWORD.sub(lambda m: f"{m.group(1)}:{REDACTED}@", text)
    for value, name in secret_values() if values is None else values:
        if value in text:
            text = text.replace(value, env_ref(name))

    def assignment(m: re.Match[str]) -> str:
        key = m.group(1).rsplit(".", 1)[-1]
        return f"{m.group(1)}={REDACTED}" if is_secret_name(key) and _named_value(m.group(2)) else m.group(0)

    def flag(m: re.Match[str]) -> str:
        name = m.group(1).lstrip("-")
        if not is_secret_name(name) or not _named_value(m.group(3)) or m.group(3).startswith("-"):
            return m.group(0)
        return f"{m.group(1)}{m.group(2)}{REDACTED}"

    return _FLAG.sub(flag, _ASSIGNMENT.sub(assignment, text))


def redact(obj: Any, path: str = "") -> Any:
    """A copy of a record (dicts, lists, strings) safe to store or print: values under secret-named
    keys become <redacted>; every string is redacted as text (redact_text)."""
    return _redact(obj, path, secret_values())


def _redact(obj: Any, path: str, values: list[tuple[str, str]]) -> Any:
    if isinstance(obj, dict):
        out = {}
        row_data = path.endswith(ROW_DATA)
        for k, v in obj.items():
            key = f"{path}.{k}" if path else str(k)
            in_env = path == "env" or path.endswith(".env")
            secret = not row_data and (is_secret_name(str(k)) or (in_env and has_url_password(v)))
            out[k] = _strike(v) if secret else _redact(v, key, values)
        return out
    if isinstance(obj, (list, tuple)):
        return [_redact(v, path, values) for v in obj]
    if isinstance(obj, str):
        return redact_text(obj, values)
    return obj


def _strike(value: Any) -> Any:
    """A secret-named key's value: strings struck (a reference to a variable stays), containers walked."""
    if isinstance(value, dict):
        return {k: _strike(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strike(v) for v in value]
    if isinstance(value, str) and value and not (env_refs(value) and ENV_REF.fullmatch(value)):
        return REDACTED
    return value


def record_json(obj: Any, **dumps: Any) -> str:
    """A record as JSON text, redacted (json.dumps's keyword arguments pass through)."""
    return json.dumps(redact(obj), **dumps)


def plain_json(obj: Any) -> str:
    """A record of batchinfer's own state (no config value in it) as JSON text, not redacted: its
    callers are listed in tests/contract/test_architecture.py."""
    return json.dumps(obj, indent=2, sort_keys=True, default=str)


class _NoAliasDumper(yaml.SafeDumper):
    """Records are read by people: no &id001 anchors for repeated values."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def record_yaml(obj: Any) -> str:
    """A record as YAML text, redacted, in its own key order, without anchors."""
    return yaml.dump(redact(obj), Dumper=_NoAliasDumper, sort_keys=False, allow_unicode=True)


class RedactingStream(io.TextIOBase):
    """A text stream (stdout, stderr) whose every write is redacted first; the rest is the stream's."""

    def __init__(self, stream: TextIO):
        self._stream = stream

    def write(self, text: str) -> int:  # type: ignore[override]
        """Redact, then write."""
        self._stream.write(redact_text(text))
        return len(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def flush(self) -> None:
        """Flush the wrapped stream."""
        self._stream.flush()

    def isatty(self) -> bool:
        """Whether the wrapped stream is a terminal (tqdm asks)."""
        return self._stream.isatty()

    def fileno(self) -> int:
        """The wrapped stream's descriptor."""
        return self._stream.fileno()


def redacting_console() -> None:
    """Redact everything this process prints to stdout and stderr (idempotent)."""
    if not isinstance(sys.stdout, RedactingStream):
        sys.stdout = RedactingStream(sys.stdout)  # type: ignore[assignment]
    if not isinstance(sys.stderr, RedactingStream):
        sys.stderr = RedactingStream(sys.stderr)  # type: ignore[assignment]


class RedactingFilter(logging.Filter):
    """A logging filter that redacts each record's message (its arguments filled in first)."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Redact the message in place; keep the record."""
        record.msg, record.args = redact_text(record.getMessage()), None
        return True
