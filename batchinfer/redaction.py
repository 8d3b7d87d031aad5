"""The one redaction: every record batchinfer writes (run.yaml, pass.json, jobs.jsonl, tune files,
trial specs, sbatch scripts) and every line it prints goes through here, so no command can forget it.

Records a command reads back to run (run.yaml, pass.json, a tune's job.json, a trial's spec.json)
hold exactly what runs (exact_json, exact_yaml): only the values of secret-named keys are struck,
never a free-text value (a prompt's `key={key}`, a stop string), which text patterns would damage.

Secrets are found as secret scanners find them: by name (secret_names.py: a secret word token,
secret, password, pass, pwd, key, jwt, cookie, ... as the name's last word after qualifier, role and
version words), by a URL's `user:password@`, by shape and
in free-text forms (secret_shapes.py: ghp_..., hf_..., `Authorization: Bearer X`), and by
value (the value of a secret-named variable of this environment, or of a secret given in the
config). A value found by value is written as `${oc.env:NAME}`, a reference the task resolves
from its own environment; one found by name becomes `<redacted>`."""

from __future__ import annotations

import json
import os
import re
from typing import Any, Optional

import yaml

from batchinfer.env_refs import ENV_REF as ENV_REF
from batchinfer.env_refs import env_ref as env_ref
from batchinfer.env_refs import env_refs as env_refs
from batchinfer.env_refs import resolve_refs as resolve_refs
from batchinfer.env_refs import shell_refs as shell_refs
from batchinfer.secret_names import is_secret_name
from batchinfer.secret_shapes import shape_of, strike_forms, strike_shapes

REDACTED = "<redacted>"

# Redaction by value: values shorter than this are common words and numbers ("true", "main",
# "1234"), which would be struck out of every record; secret scanners and CI masks draw the line
# at 8 characters too (GitLab refuses to mask shorter ones). Shorter secrets are caught by name.
MIN_VALUE_LENGTH = 8
# Subtrees whose keys are the user's columns, not settings: few-shot examples, run.yaml's column summary.
ROW_DATA = ("prompt.examples", "output_schema.columns")
# Maps whose keys are the user's labels, not settings nor variables: a LoRA adapter named `auth`
# or `token_classifier` holds a folder, no secret.
LABEL_MAPS = ("model.lora.adapters",)
# Lists of Hydra overrides in records read back (pass.json, a tune's job.json, a trial's spec.json):
# a secret-named key's value is struck from each (strike_override), the rest kept as typed.
OVERRIDE_LISTS = frozenset({"overrides", "tries"})

# scheme://user:password@: one slash or more, as a path's normalisation leaves it (https:/bob:pw@host).
# The user may be empty (redis://:PASSWORD@host); the password runs to the last @ before the host
# (postgres://bob:p@ss@db: a password may hold an @).
# A scheme is at most 32 characters (git+ssh, postgresql+psycopg2): unbounded, the scheme would be
# rescanned to the end of the text from every word boundary ('a-a-a-...' took quadratic time).
_URL_PASSWORD = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]{0,31}:/+[^\s:/@'\"${}]*):([^\s/'\"]+)@")
# NAME=value as a shell line or an override writes it (+cluster.env.DB_PASS=x); $NAME values are references.
# An unquoted value ends at a quote: the quote closes the text around it ('token=abc' keeps its closing
# quote); a quote never closed opens the value up to a space (a parse error's TOKEN='abc); a `{name}`
# group is taken whole (a template's placeholder, kept by _named_value).
_ASSIGNMENT = re.compile(
    r"(?<![\w$.\-])([+~]{0,2}[A-Za-z_][\w.\-]*)=(\"[^\"]*\"|'[^']*'|[\"'][^\s'\"]*|\{+[^{}\s'\"]*\}+|[^\s;&|,)\]}`'\"]+)"
)
# --token VALUE, --api-key=VALUE: an option with a secret name and its argument.
_FLAG = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)(=|[ \t]+)(\"[^\"]*\"|'[^']*'|[\"'][^\s'\"]*|[^\s;&|`'\"]+)")
# A value in a command line: up to a space, a quote or a shell separator.
_VALUE = r"(?P<secret>[^\s'\";&|`]+)"


def _tail(word: str) -> str:
    """The rest of a command after its name `word`, up to a shell separator, never past the next
    `word`: each occurrence then scans only up to the next one, so text repeating the word
    ('curl curl curl ...') is scanned once, not from every occurrence to its end."""
    return rf"(?:(?!\b(?:{word})\b)[^;&|\n])*?"


# Commands that take a secret in their own syntax: the secret (and a header's name or a setting's
# name, where the form has one: it must name a secret) found as a secret scanner finds it.
_COMMAND_SECRETS = (
    # curl -H 'Authorization: Bearer X', --header="X-Api-Key: X", git's http.extraheader "AUTHORIZATION: basic X"
    re.compile(
        r"(?:(?<![\w-])-H|--header|extraheader)(?:\s+|=)['\"]?(?P<name>[A-Za-z][\w-]*)[ \t]*:[ \t]*"
        r"(?:(?i:bearer|basic|token|bot|digest|apikey)[ \t]+)?" + _VALUE
    ),
    # mysql -pX, -p'X': the password glued to -p
    re.compile(r"\b(?:mysql\w*|mariadb[\w-]*)\b" + _tail(r"mysql\w*|mariadb[\w-]*") + r"[ \t]-p['\"]?" + _VALUE),
    # curl -u alice:X, -ualice:X (--user, --proxy-user, -U): the part after the user name
    re.compile(
        r"\bcurl\b"
        + _tail("curl")
        + r"[ \t](?:-[uU][ \t=]*|(?:--user|--proxy-user)(?:[ \t]+|=))['\"]?[^\s:'\"]*:"
        + _VALUE
    ),
    # sshpass -p X
    re.compile(r"\bsshpass\b" + _tail("sshpass") + r"[ \t]-p[ \t]*" + _VALUE),
    # aws configure set aws_secret_access_key X, git config user.password X, npm config set //r/:_authToken X
    # (a tool's command only: a prompt saying "the config key is ..." stays as written)
    re.compile(
        r"\b(?:aws|git|npm|pnpm|yarn|pip|gh|conda|poetry)[ \t]+config(?:ure)?\b(?:[ \t]+--?[\w.-]+)*(?:[ \t]+set)?"
        r"[ \t]+(?P<name>[\w.\-/:@]+)[ \t]+['\"]?" + _VALUE
    ),
    # https://TOKEN@github.com/...: a user without a password in an http(s) URL is a token
    re.compile(r"\bhttps?://(?P<secret>[^\s:/@'\"${}]+)@"),
)
# What a message writes where a value goes (`export HF_TOKEN=...`, --token <TOKEN>, a template's
# key={key} or key={{key}} placeholder): no value.
_PLACEHOLDER = re.compile(r"\.\.\.|\u2026|<[^<>\s]*>|\*{3,}|\{+[\w.\[\]-]*\}+")

# Secrets given in the config (cluster.env, cluster.env_inherit) of this process: name -> value.
_carried: dict[str, str] = {}
# Values of secret-named keys as typed in overrides (and URL passwords there): value -> name, struck
# from every line of this process by value, before the config is composed (a type error echoes them).
_typed: dict[str, str] = {}


def has_url_password(value: Any) -> bool:
    """Whether a value holds a URL with a password (postgres://user:password@host/db)."""
    return isinstance(value, str) and _URL_PASSWORD.search(value) is not None


def is_secret_value(value: Any) -> bool:
    """Whether a value is a secret whatever its name: a URL with a password, or a value of a known
    secret's shape (secret_shapes.VALUE_SHAPES: ghp_..., hf_..., sk-..., a Slack webhook, a JWT)."""
    return isinstance(value, str) and (has_url_password(value) or shape_of(value) is not None)


def is_secret_entry(name: str, value: Any) -> bool:
    """An environment entry (cluster.env) to keep out of files: a secret name, a URL's password, or
    one a record already holds struck (a URL entry read back from run.yaml at resume is no URL any
    more, and exported as written it would override the real value the task gets)."""
    return value is not None and (is_secret_name(name) or is_secret_value(str(value)) or REDACTED in str(value))


def carry(name: str, value: Any) -> None:
    """Remember a secret given in the config: its value is struck from every record of this process."""
    if value is not None and str(value) != REDACTED and not env_refs(str(value)):
        _carried[name] = str(value)


def strike_overrides(overrides: list[str]) -> None:
    """Remember the secrets typed in Hydra overrides (a secret-named key's value, a URL's password):
    an error about any key that echoes one, before the config is checked, prints it struck."""
    for ov in overrides:
        key, sep, value = ov.partition("=")
        name = key.lstrip("+~").rsplit(".", 1)[-1]
        value = _unquoted(value)
        env = key.lstrip("+~").startswith("cluster.env.")  # struck as cluster.env's secrets are, by reference
        if sep and is_secret_name(name) and _named_value(value, name):
            _typed[value] = name if env else ""
        for m in _URL_PASSWORD.finditer(value):
            _typed[m.group(2)] = ""


def carried() -> dict[str, str]:
    """The secrets given in the config of this process (name -> value), for a child's environment."""
    return dict(_carried)


def secret_values() -> list[tuple[str, str]]:
    """(value, name) of every secret known here, longest value first: secret-named variables of this
    environment, secrets given in the config and typed in overrides (name "": no variable holds it),
    values of MIN_VALUE_LENGTH characters or more."""
    found = {v: k for k, v in os.environ.items() if len(v) >= MIN_VALUE_LENGTH and is_secret_name(k)}
    found.update({v: k for k, v in _carried.items() if len(v) >= MIN_VALUE_LENGTH})
    found.update({v: k for v, k in _typed.items() if len(v) >= MIN_VALUE_LENGTH})
    return sorted(found.items(), key=lambda kv: -len(kv[0]))


def _unquoted(value: str) -> str:
    return value[1:-1] if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"" else value


def _named_value(value: str, name: str = "") -> bool:
    """A value that is a secret to strike: not a reference ($NAME, ${oc.env:NAME}), already struck, a
    message's placeholder (`...`, <TOKEN>) nor the name itself (`token=token` in a traceback)."""
    inner = _unquoted(value)
    if not inner or inner.startswith("$") or REDACTED in inner or _PLACEHOLDER.fullmatch(inner):
        return False
    return inner != name.lstrip("+~-").rsplit(".", 1)[-1]


def _command_secrets(text: str) -> str:
    """Secrets in the syntax of commands that take one (_COMMAND_SECRETS) struck, the rest kept."""

    def strike(m: re.Match[str]) -> str:
        named = "name" not in m.re.groupindex or is_secret_name(m.group("name"))
        if not named or not _named_value(m.group("secret")):
            return m.group(0)
        start, end = m.span("secret")
        return m.group(0)[: start - m.start()] + REDACTED + m.group(0)[end - m.start() :]

    for form in _COMMAND_SECRETS:
        text = form.sub(strike, text)
    return text


def redact_text(text: str, values: Optional[list[tuple[str, str]]] = None) -> str:
    """A line or a value with its secrets struck: URL passwords, known secret values (as references
    to their variable), and the values of secret-named assignments and options."""
    if not text:
        return text
    text = strike_shapes(_URL_PASSWORD.sub(lambda m: f"{m.group(1)}:{REDACTED}@", text), REDACTED)
    for value, name in secret_values() if values is None else values:
        if value in text:
            text = text.replace(value, env_ref(name) if name else REDACTED)

    def assignment(m: re.Match[str]) -> str:
        key = m.group(1).rsplit(".", 1)[-1]
        secret = is_secret_name(key) and _named_value(m.group(2), key)
        return f"{m.group(1)}={REDACTED}" if secret else m.group(0)

    def flag(m: re.Match[str]) -> str:
        name = m.group(1).lstrip("-")
        if not is_secret_name(name) or not _named_value(m.group(3), name) or m.group(3).startswith("-"):
            return m.group(0)
        return f"{m.group(1)}{m.group(2)}{REDACTED}"

    text = _command_secrets(_FLAG.sub(flag, _ASSIGNMENT.sub(assignment, text)))
    return strike_forms(text, REDACTED, _named_value)


def shown_change(old: str, new: str) -> str:
    """`OLD -> NEW` for a message, or `differs in a redacted part` when the two print the same once
    struck (the difference is inside a secret-shaped part: `token=aaaa` -> `token=bbbb`), instead
    of two identical texts."""
    if old != new and redact_text(old) == redact_text(new):
        return "differs in a redacted part"
    return f"{old} -> {new}"


# A JSON string literal, as json.dumps writes it.
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def redact_printed(text: str) -> str:
    """A printed text with its secrets struck (redact_text); a JSON document (`--json`) string by
    string, so that a value ending in `key=` cannot swallow the quote after it and break the JSON."""
    stripped = text.strip()
    if stripped[:1] in ("{", "[") and stripped[-1:] in ("}", "]"):
        try:
            json.loads(stripped)
        except ValueError:
            return redact_text(text)
        return _JSON_STRING.sub(_redact_json_string, text)
    return redact_text(text)


def _redact_json_string(m: re.Match[str]) -> str:
    value = json.loads(m.group(0))
    struck = redact_text(value)
    return m.group(0) if struck == value else json.dumps(struck, ensure_ascii=False)


def redact(obj: Any, path: str = "") -> Any:
    """A copy of a record (dicts, lists, strings) safe to store or print: values under secret-named
    keys become <redacted>; every string is redacted as text (redact_text)."""
    return _redact(obj, path, secret_values())


def _redact(obj: Any, path: str, values: list[tuple[str, str]]) -> Any:
    if isinstance(obj, dict):
        out = {}
        row_data = path.endswith(ROW_DATA) or path.endswith(LABEL_MAPS)
        for k, v in obj.items():
            key = f"{path}.{k}" if path else str(k)
            in_env = path == "env" or path.endswith(".env")
            secret = not row_data and (is_secret_name(str(k)) or (in_env and is_secret_value(v)))
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


def strike_override(override: str) -> str:
    """A Hydra override (or a --try's words) as a record read back keeps it: a secret-named key's
    value (cluster.env.HF_TOKEN=..., env.HF_TOKEN=...) struck, or a URL's password in an
    environment entry; any other override exactly as typed."""
    key, sep, value = override.partition("=")
    path = key.lstrip("+~")
    name = path.rsplit(".", 1)[-1]
    env = path.startswith(("cluster.env.", "env."))
    label = any(path.startswith(m + ".") for m in LABEL_MAPS)
    secret = not label and (is_secret_name(name) or (env and is_secret_value(_unquoted(value))))
    if sep and secret and _named_value(value, name):
        return f"{key}={REDACTED}"
    return override


def strike_try(text: str) -> str:
    """A tune's --try ('k=v env.NAME=V', shell words) with its secret values struck (strike_override)."""
    import shlex

    try:
        words = shlex.split(text)
    except ValueError:
        return text  # refused when parsed (tune/settings.py): no setting to strike
    struck = [strike_override(w) for w in words]
    if struck == words:
        return text
    return " ".join(
        s if s != w else shlex.quote(w) for s, w in zip(struck, words, strict=True)
    )  # `k=<redacted>` splits as one


def _struck_by_exact(path: str, k: Any, v: Any) -> bool:
    """Whether exact() strikes the value of key k of the map at path: a secret-named key (not a row's
    column nor a map's label), or an environment entry holding a URL's password or a shaped secret."""
    if path.endswith(ROW_DATA) or path.endswith(LABEL_MAPS):
        return False
    return is_secret_name(str(k)) or ((path == "env" or path.endswith(".env")) and is_secret_value(v))


def exact(obj: Any, path: str = "") -> Any:
    """A copy of a record read back to run: the values of secret-named keys struck (and a URL's
    password in an environment entry), lists of overrides struck as strike_override does; every
    other value exactly as it is, so what a command reads back is what the user gave."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            key = f"{path}.{k}" if path else str(k)
            if _struck_by_exact(path, k, v):
                out[k] = _strike(v)
            elif str(k) in OVERRIDE_LISTS and isinstance(v, (list, tuple)):
                strike = strike_try if k == "tries" else strike_override
                out[k] = [strike(o) if isinstance(o, str) else exact(o, key) for o in v]
            else:
                out[k] = exact(v, key)
        return out
    if isinstance(obj, (list, tuple)):
        return [exact(v, path) for v in obj]
    return obj


def struck_by_older(obj: Any, path: str = "") -> list[str]:
    """The keys of a record read back to run (run.yaml's config) whose value holds REDACTED where
    exact() keeps the value as given: text an older batchinfer's text redaction struck out of what
    runs (`key=<redacted>` in a prompt). An environment entry holding it is a secret's place (taken
    from the environment: security.secret_value), as are the values exact() strikes."""
    if isinstance(obj, dict):
        in_env = path == "env" or path.endswith(".env")
        found: list[str] = []
        for k, v in obj.items():
            key = f"{path}.{k}" if path else str(k)
            if _struck_by_exact(path, k, v) or (in_env and isinstance(v, str) and REDACTED in v):
                continue
            found += [f for f in struck_by_older(v, key) if f not in found]
        return found
    if isinstance(obj, (list, tuple)):
        found = []
        for v in obj:
            found += [f for f in struck_by_older(v, path) if f not in found]
        return found
    return [path] if isinstance(obj, str) and REDACTED in obj else []


def exact_json(obj: Any, **dumps: Any) -> str:
    """A record read back to run as JSON text (exact; json.dumps's keyword arguments pass through)."""
    return json.dumps(exact(obj), **dumps)


def exact_yaml(obj: Any) -> str:
    """A record read back to run (run.yaml) as YAML text (exact), in its own key order, without anchors."""
    return yaml.dump(exact(obj), Dumper=_NoAliasDumper, sort_keys=False, allow_unicode=True)


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
