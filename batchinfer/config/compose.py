"""Compose a config from conf/ and Hydra overrides typed in a shell, with errors that name the key."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig

from batchinfer.config.checks import takes, validate
from batchinfer.config.keys import schema_keys, unknown_key_message, unknown_keys
from batchinfer.config.schema import escape_interpolation
from batchinfer.config.store import conf_dir, register_configs
from batchinfer.errors import ConfigError
from batchinfer.redaction import REDACTED, has_url_password, is_secret_name, strike_override, strike_overrides
from batchinfer.secret_shapes import shape_of

# Values typed in a shell that Hydra's grammar would reject or interpolate ({, [, #, ${): taken as typed.
LITERAL_KEYS = ("prompt.template", "prompt.system", "task.query", "task.document")
# The same, except that a value wholly in Hydra's quotes ('[a-z]+') keeps Hydra's meaning (the quotes
# go), as these keys had to be written before they were taken literally, and `null` unsets the key.
LITERAL_UNLESS_QUOTED_KEYS = (
    "prompt.labels.description",
    "sampling.structured_outputs.regex",
    "sampling.structured_outputs.json",
    "sampling.structured_outputs.grammar",
)
# List keys whose one-string value is one item, taken as typed (`sampling.stop=###` is ["###"]); a
# value in brackets is Hydra's list syntax (`sampling.stop=[a,b]`).
LITERAL_LIST_KEYS = ("sampling.stop",)


def hydra_literal(value: str) -> str:
    """Quote a raw string so Hydra's grammar and OmegaConf give it back unchanged."""
    value = escape_interpolation(value)
    value = re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, value)
    return "'" + value.replace("'", "\\'") + "'"


# One string in Hydra's single or double quotes, as its grammar reads it (a backslash escapes the quote).
_HYDRA_QUOTED = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"", re.S)


def quote_literals(overrides: list[str]) -> list[str]:
    """Pass text keys (prompt.template, a regex, inline JSON, ...) through Hydra literally, as typed
    in the shell; a one-string value of a list key (sampling.stop=###) becomes a list of it."""
    out = []
    for ov in overrides:
        key, sep, value = ov.partition("=")
        name, quoted = key.lstrip("+~"), _HYDRA_QUOTED.fullmatch(value) is not None
        # `null` unsets an optional key, as before (a regex that is the word null: write 'null')
        hydra = quoted or value == "null"
        if sep and (name in LITERAL_KEYS or (name in LITERAL_UNLESS_QUOTED_KEYS and not hydra)):
            ov = f"{key}={hydra_literal(value)}"
        elif sep and name in LITERAL_LIST_KEYS and value and not value.startswith("["):
            ov = f"{key}=[{value if quoted else hydra_literal(value)}]"
        elif sep and REDACTED in value and not quoted:  # a recorded override (pass.json, a trial's spec)
            ov = f"{key}={hydra_literal(value)}"
        out.append(ov)
    return out


def compose(overrides: list[str], config_dir: Optional[str] = None) -> DictConfig:
    """Compose conf/config.yaml with Hydra overrides; errors name the bad key."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    register_configs()
    strike_overrides(list(overrides))  # an error below may echo a value: a secret's is printed struck
    given = list(overrides)
    overrides = quote_literals(list(overrides))
    if config_dir:
        cdir = Path(config_dir).expanduser().resolve()
        if not cdir.exists():
            raise ConfigError(f"--config-dir {config_dir}: no such directory (resolved to {cdir})")
        if not cdir.is_dir():
            raise ConfigError(f"--config-dir {config_dir}: not a directory (resolved to {cdir})")
        if not os.access(cdir, os.R_OK | os.X_OK):
            raise ConfigError(f"--config-dir {config_dir}: not readable (permission denied)")
        overrides.append(f"hydra.searchpath=[{hydra_literal(f'file://{cdir}')}]")  # any folder name
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
            cfg = hydra_compose(config_name="config", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(_secret_parse_error(given, overrides[: len(given)]) or _override_error(e)) from None
    finally:
        GlobalHydra.instance().clear()
    from omegaconf.errors import InterpolationResolutionError

    try:
        unknown = unknown_keys(cfg)
        if unknown:
            raise ConfigError(unknown_key_message(unknown[0]))
        validate(cfg)
    except InterpolationResolutionError as e:  # an unset ${oc.env:NAME}: a traceback before
        raise ConfigError(_unresolved(cfg, e)) from None
    from batchinfer.config.model_fit import check_model_fit

    check_model_fit(cfg)
    return cfg


def _unresolved(cfg: DictConfig, e: Exception) -> str:
    """An interpolation that cannot be resolved, named with the keys that hold it and what to do."""
    from omegaconf import OmegaConf

    found = re.search(r"Environment variable '([^']+)' not found", str(e))
    if not found:
        return str(e).splitlines()[0]
    name, keys = found.group(1), []

    def walk(node: object, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{prefix}[{i}]")
        elif isinstance(node, str) and f"oc.env:{name}" in node:
            keys.append(prefix)

    walk(OmegaConf.to_container(cfg, resolve=False), "")
    where = ", ".join(keys) or "a config value"
    return f"{where} refers to ${{oc.env:{name}}}, which is not set in this shell: `export {name}=...` first, or give {where} a plain value"


def apply_overrides(cfg: DictConfig, overrides: list[str]) -> None:
    """Hydra's key=value overrides (its grammar, as on the command line) applied onto a config in place."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    strike_overrides(list(overrides))
    quoted = quote_literals(overrides)
    try:
        for ov in OverridesParser.create().parse_overrides(quoted):
            OmegaConf.update(cfg, ov.key_or_group, ov.value(), merge=True, force_add=ov.is_add())
    except (HydraException, OmegaConfBaseException) as e:
        from omegaconf.errors import ValidationError

        if isinstance(e, ValidationError) and getattr(e, "full_key", None):  # resume's type errors name the key
            raise ConfigError(_validation_message(e)) from None
        raise ConfigError(_secret_parse_error(overrides, quoted) or str(e).splitlines()[0]) from None


# A key inside a dict's text (`{HF_TOKEN: x`, `, 'API_KEY'=x`) or a brace: what a parse error's echo of
# the value would show a secret beside (H3).
_DICT_TOKEN = re.compile(r"[{}]|(?<=[{,])\s*[\'\"]?([A-Za-z_][\w.\-]*)[\'\"]?\s*[:=]")


def secret_keys_inside(value: str) -> list[str]:
    """The secret-named keys (redaction.is_secret_name) a dict's text in an override's value names,
    each as its path inside the value (`env.HF_TOKEN` in `{env:{HF_TOKEN:x}}`)."""
    found: list[str] = []
    parents: list[str] = []  # the key each open brace is the value of ("" for the outermost)
    last = ""
    for m in _DICT_TOKEN.finditer(value):
        if m.group(0) == "{":
            parents.append(last)
            last = ""
        elif m.group(0) == "}":
            last = parents.pop() if parents else ""
        else:
            last = m.group(1)
            if is_secret_name(last.rsplit(".", 1)[-1]):
                found.append(".".join([p for p in parents[1:] if p] + [last]))
    return found


# `${oc.env:NAME,default}`: the default stands in for NAME's value, so a secret-named NAME's default is a secret (H3).
_ENV_DEFAULT = re.compile(r"\$\{oc\.env:\s*['\"]?([A-Za-z_]\w*)['\"]?\s*,")


def secret_env_defaults(value: str) -> list[str]:
    """The secret-named variables (redaction.is_secret_name) whose `${oc.env:NAME,default}` in value
    gives a default: that default is a secret as the variable's value is."""
    return [n for n in _ENV_DEFAULT.findall(value) if is_secret_name(n)]


def secret_parse_error(typed: str) -> Optional[str]:
    """Why an override holding a secret that Hydra's grammar cannot read is refused, naming the key
    and how to write it (None: it parses, or it holds no secret). One home for compose, resume's and
    redo's overrides (apply_overrides) and tune's --try words (tune/settings.py)."""
    return _secret_parse_error([typed], quote_literals([typed]))


def _secret_parse_error(given: list[str], quoted: list[str]) -> Optional[str]:
    """An override holding a secret (a secret-named key's value, a secret-named key inside a dict's
    text, a URL's password, a value of a secret's shape) that Hydra's grammar cannot read: said naming
    the key and how to write it. Hydra's own message echoes the override, or the part of the value
    where it stopped (`no viable alternative at input '[ab'`), which no text pattern can tell for a
    secret (K14, H3)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    for typed, ov in zip(given, quoted, strict=True):
        key, sep, value = typed.partition("=")
        # the key's name decides, whatever the value's form (a ${oc.decode:...} is no reference to keep)
        secret_key = strike_override(f"{key}=value") != f"{key}=value"
        inside = secret_keys_inside(value)
        defaults = secret_env_defaults(value)
        secret = secret_key or inside or defaults or has_url_password(value) or shape_of(value)
        # a value Hydra's lexer cannot read (a fullwidth letter in a dict's key) is echoed whole (H3b)
        bracketed = any(c in value for c in "{}[]")
        if not sep or not (secret or bracketed):
            continue
        try:
            parser.parse_override(ov)
        except HydraException as e:
            name = key.lstrip("+~")
            if not secret:
                if not any(w in str(e) for w in ("token recognition error", "LexerNoViableAltException")):
                    continue
                return (
                    f"{name}: Hydra's override grammar cannot read the value given (a character its lexer "
                    f"does not take, such as a fullwidth letter in a key; the value is not shown: it may "
                    f"hold a secret); write the keys in ASCII, or give each entry as its own override in "
                    f"the dot form, \"{key}.KEY='...'\""
                )
            if defaults and not secret_key and not inside:
                return (
                    f"{name}: Hydra's override grammar cannot read the value given (not shown: it holds the "
                    f"default of ${{oc.env:{defaults[0]},...}}, a secret, as {defaults[0]}'s value is); "
                    f"give no default: `export {defaults[0]}=...` in this shell and write ${{oc.env:{defaults[0]}}} "
                    f"or name it in cluster.env_inherit=[{defaults[0]}]"
                )
            if inside and not secret_key:
                entry = f"+{name}.{inside[0]}"  # a dict key of an open map (cluster.env) is new: `+`
                return (
                    f"{name}: Hydra's override grammar cannot read the value given (not shown: it holds "
                    f"{', '.join(dict.fromkeys(inside))}, a secret); give each entry as its own override in "
                    f"the dot form, such as \"{entry}='...'\" (a ' inside as \\')"
                )
            by_name = (
                f", or pass it by name: `export {name.rsplit('.', 1)[-1]}` in this shell and "
                f"cluster.env_inherit=[{name.rsplit('.', 1)[-1]}]"
                if name.startswith("cluster.env.")
                else ""
            )
            what = "it is a secret" if secret_key else "it holds a URL's password or a secret's value"
            return (
                f"{name}: Hydra's override grammar cannot read the value given (not shown: {what}); "
                f"write it in Hydra's quotes, \"{key}='...'\" (a ' inside as \\'){by_name}"
            )
    return None


def _first_lines(msg: str) -> str:
    # Hydra appends a long "Set the environment variable HYDRA_FULL_ERROR" tail.
    lines = [ln for ln in msg.splitlines() if ln.strip() and "HYDRA_FULL_ERROR" not in ln]
    return "\n".join(lines[:4])


def _override_error(e: Exception) -> str:
    """Hydra's "Error merging override k=v" names neither the type nor the range: add both."""
    from omegaconf.errors import ValidationError

    missing = re.search(r"Could not override '([^']+)'", str(e))
    if missing:  # Hydra's advice (write +key) would add a key nothing reads, or echo the value
        key = missing.group(1)
        # a dict assigned to a key (cluster.env={A: b}): the key missing is the one inside it
        inner = getattr(e.__cause__, "full_key", None)
        key = inner if isinstance(inner, str) and inner.startswith(f"{key}.") else key
        return new_key_message(key) or unknown_key_message(key)
    cause = e.__cause__
    if not isinstance(cause, ValidationError) or not getattr(cause, "full_key", None):
        return _first_lines(str(e))
    return _validation_message(cause)


def _validation_message(cause: Exception) -> str:
    """OmegaConf's type error named with its key and what the key takes; a secret's value struck."""
    key = str(getattr(cause, "full_key", ""))
    reason = str(cause).splitlines()[0]
    value = getattr(cause, "value", None)
    if value is not None and (is_secret_name(key.rsplit(".", 1)[-1]) or has_url_password(str(value))):
        reason = reason.replace(str(value), REDACTED)  # a secret's value, whatever its type, is not echoed
    allowed = takes(key)
    return f"{key}: {reason}" + (f"; {key} takes {allowed}" if allowed else "")


def new_key_message(key: str) -> Optional[str]:
    """For a key of a free-form section (cluster.env, sbatch_extra, ...) written without `+`: how to
    add it; None for any other key. The value is not echoed (it may be a secret)."""
    section, name = key.rsplit(".", 1) if "." in key else ("", key)
    parent, names = schema_keys(section) if section else ("", [])
    if section.rsplit(".", 1)[-1] not in names or schema_keys(key)[1]:
        return None  # not a key of the schema, or a section with keys of its own
    msg = f"{section} has no key {name} yet: write +{key}=... to add it"
    if section == "cluster.env":
        msg += (
            f" (or, for a secret, pass it by name: `export {name}` in this shell and "
            f"cluster.env_inherit=[{name}], so its value is on no command line)"
        )
    return msg


def require_run_keys(cfg: DictConfig, input_required: bool = True) -> None:
    """The keys a run cannot start without."""
    if input_required and not cfg.input.path:
        raise ConfigError("input.path is not set: add input.path=/path/to/corpus.jsonl")
    if not cfg.model.path:
        raise ConfigError("model.path is not set: add model.path=/path/to/hf-model-folder or a preset")
