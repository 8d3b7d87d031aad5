"""Shared-cluster safety: secrets in the config, the environment secrets travel in, modes of DIR, safe
removal (what a record may hold: redaction.py)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

from batchinfer.errors import ConfigError
from batchinfer.redaction import (
    ENV_REF,
    LABEL_MAPS,
    REDACTED,
    ROW_DATA,
    carry,
    env_refs,
    has_url_password,
    is_secret_entry,
    is_secret_name,
    redact_text,
    resolve_refs,
    secret_values,
)
from batchinfer.secret_shapes import shape_of

PRIVATE = {"user": (0o077, 0o700), "group": (0o027, 0o750)}  # umask, DIR mode


# NAME=value (NAME+=value) in a shell line, the value given (not $NAME or ${NAME}): what cluster.setup stores.
_ASSIGNMENT = re.compile(r"(?<![\w$])([A-Za-z_][A-Za-z0-9_]*)\+?=(?![\s$\"']*\$)([^\s;&|]+)")


# Values that become `#SBATCH --key=value` lines: sbatch reads no variable there, so a secret's
# `${oc.env:NAME}` cannot wait for the task; it would be resolved into the script.
DIRECTIVE_KEYS = ("partition", "account", "qos", "mem", "constraint", "merge_mem")


def check_config_secrets(c: dict[str, Any]) -> None:
    """Refuse secrets where they would be stored: secret-named values outside cluster.env, secrets
    set or given literally in cluster.setup, secret interpolations in #SBATCH values; then
    remember the config's secrets, so that no record of this process holds their values."""
    cluster = c.get("cluster") or {}
    lines = [(f"cluster.setup[{i}]", line) for i, line in enumerate(cluster.get("setup") or [])]
    lines += [(f"cluster.sbatch_extra.{k}", v) for k, v in (cluster.get("sbatch_extra") or {}).items()]
    for where, line in lines:
        for name, _ in _ASSIGNMENT.findall(str(line)):
            if is_secret_name(name):
                raise ConfigError(
                    f"{where} sets {name}, which looks like a secret, and the config is stored in DIR/run.yaml "
                    f"(and the sbatch script in DIR/logs) where others may read it. `export {name}=...` before "
                    f"running batchinfer and name it in cluster.env_inherit=[{name}] (Slurm passes your "
                    f"environment to the jobs), or pass it as cluster.env.{name}=..., which is never stored"
                )
        struck = redact_text(str(line))
        if REDACTED in struck:  # a secret of this environment becomes a reference to it
            shown = struck if len(struck) <= 200 else struck[:200] + "..."
            raise ConfigError(
                f"{where} gives a secret ({shown!r}: a password, a token or a key as an argument, in a "
                f"file it writes or a login), and the sbatch script is stored in DIR/logs where others may "
                f"read it: write $NAME there instead (the task's shell expands it), with NAME set in this "
                f"shell and named in cluster.env_inherit=[NAME]"
            )
    directives = [(f"cluster.{k}", cluster.get(k)) for k in DIRECTIVE_KEYS]
    directives += [(f"cluster.sbatch_extra.{k}", v) for k, v in (cluster.get("sbatch_extra") or {}).items()]
    for key, value in directives:
        secret = [n for n in env_refs(str(value or "")) if is_secret_name(n)]
        if secret:
            raise ConfigError(
                f"{key} takes ${{oc.env:{secret[0]}}}, a secret: it would be written into the #SBATCH lines "
                f"stored in DIR/logs (sbatch expands no variable there); give {key} a plain value"
            )
    for key in _secret_keys(c, ""):
        raise ConfigError(
            f"{key} looks like a secret, and the config is stored in DIR/run.yaml where others may read it. "
            f"Put it in the environment instead (e.g. `export HF_TOKEN=...` before running batchinfer, with "
            f"cluster.env_inherit=[HF_TOKEN]: Slurm passes your environment to the jobs), or as "
            f"cluster.env.NAME, which is never stored"
        )
    carry_secrets(cluster)
    check_secret_values(c)


def check_secret_values(c: dict[str, Any]) -> None:
    """Refuse a URL's password, or a secret's value (a secret-named variable's of this environment,
    or one given in cluster.env / cluster.env_inherit), inside any other config value: records hold exactly what
    runs, so it would be stored; rewriting it into a reference would run other text where the
    variable is missing."""
    values = secret_values()
    for key, text in _string_values(c, ""):
        refuse_secret_in(key, text, values, shapes=not is_path_key(key))


# Config keys whose value is a path: a path is never a secret by its shape (a folder may be named
# sk-learn-... or hold a primer), though a URL's password or a secret's value in it still is.
PATH_KEYS = ("input.path", "output.dir", "model.path", "prompt.template_file", "cluster.cache_dir")


def is_path_key(key: str) -> bool:
    """Whether the config key holds a path (PATH_KEYS, or one of model.lora.adapters' folders)."""
    return key in PATH_KEYS or key.startswith("model.lora.adapters.")


def refuse_secret_in(
    key: str,
    text: str,
    values: Optional[list[tuple[str, str]]] = None,
    record: str = "the config is stored in DIR/run.yaml",
    shapes: bool = True,
) -> None:
    """ConfigError when a value a record holds exactly (a config value, redo's --where) holds a URL's
    password, a value of a known secret shape, or a secret's value (secret_values), naming the key and
    the variable or the kind of secret, never the value; shapes=False for a path (is_path_key)."""
    shape = shape_of(text) if shapes else None
    if shape:
        raise ConfigError(
            f"{key} holds what looks like {shape}, and {record} where others may read it (tasks, resume and "
            f"redo run what it holds, so it is not struck there either): take it out of {key} and pass it in "
            f"the environment (`export NAME=...` in this shell and cluster.env_inherit=[NAME]); if it is no "
            f"secret (an example in a prompt), put it in the input rows instead (data, which DIR/input keeps "
            f"as private as your input file)"
        )
    if has_url_password(text):
        raise ConfigError(
            f"{key} holds a URL with a password, and {record} where others may "
            f"read it (tasks, resume and redo run what it holds, so it is not struck there either): give "
            f"the URL without its password and the password in the environment your tool reads (a "
            f"variable exported and named in cluster.env_inherit, or ~/.netrc), then run the command again"
        )
    for value, name in secret_values() if values is None else values:
        if value in text:
            whose = f"the value of {name}, a secret" if name else "a password given in the overrides"
            advice = (
                f"; if it is no secret, unset {name} in this shell or give it a name without a secret word"
                if name
                else ""
            )
            raise ConfigError(
                f"{key} holds {whose} ({len(value)} characters), and {record} "
                f"where others may read it (tasks, resume and redo run what it holds, so the value is "
                f"neither stored nor rewritten): take it out of {key}{advice}, then run the command again"
            )


def check_file_secrets(files: Mapping[str, str], contents: Mapping[str, bytes]) -> None:
    """Refuse a file the config names (prompt.template_file, a JSON schema) holding a secret, line by
    line as inline text is refused (refuse_secret_in): it is copied into DIR/files, stored as run.yaml is."""
    values = secret_values()
    for key, path in files.items():
        for n, line in enumerate(contents[key].decode("utf-8", errors="replace").splitlines(), 1):
            refuse_secret_in(f"{key} {path}:{n}", line, values, "the file is copied into DIR/files")


def _string_values(node: Any, key: str) -> Iterator[tuple[str, str]]:
    """(key, text) of every string in a config, cluster.env's secret entries (the secrets
    themselves, never stored) left out."""
    if isinstance(node, dict):
        for k, v in node.items():
            sub = f"{key}.{k}" if key else str(k)
            if key == "cluster.env" and is_secret_entry(str(k), v):
                continue
            yield from _string_values(v, sub)
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            yield from _string_values(v, f"{key}[{i}]")
    elif isinstance(node, str):
        yield key, node


def carry_secrets(cluster: dict[str, Any]) -> None:
    """Remember the secrets of cluster.env and the values of cluster.env_inherit's variables: no
    record or printed line of this process holds them."""
    for name, value in (cluster.get("env") or {}).items():
        if is_secret_entry(name, value):
            carry(name, value)
    for name in cluster.get("env_inherit") or []:
        if name in os.environ:
            carry(name, os.environ[name])


def _secret_keys(node: Any, prefix: str) -> Iterator[str]:
    # a map's labels (LABEL_MAPS: a LoRA adapter's name) are no variables: `auth` there is a name
    if prefix in ROW_DATA or prefix in LABEL_MAPS or prefix == "cluster.env" or not isinstance(node, dict):
        return
    for k, v in node.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if is_secret_name(k) and v not in (None, "", REDACTED) and not env_refs(str(v)):
            yield key
        yield from _secret_keys(v, key)


def secret_value(name: str, value: Any, key: str = "", folder: str = "DIR") -> str:
    """A secret entry's value to pass on: as given, or (struck in a record, e.g. at resume, or in a
    tune job) this process's environment's own; refused naming key (cluster.env.NAME) when unset."""
    text = resolve_refs(str(value))
    if REDACTED not in text and not env_refs(text):
        return text
    key = key or f"cluster.env.{name}"
    if name not in os.environ:
        raise ConfigError(
            f"{key} is a secret, and secrets are not stored in {folder}: `export {name}=...` "
            f"in this shell (or pass {key}=... again), then run the command again"
        )
    return os.environ[name]


def secret_env(env: Mapping[str, Optional[str]], inherit: Sequence[str] = ()) -> dict[str, str]:
    """The secrets to pass through the environment of sbatch: cluster.env's secret entries (given
    values, or for <redacted> ones, e.g. at resume, the submitting shell's own) and the variables
    cluster.env_inherit names, which this shell must have."""
    out = {name: secret_value(name, value) for name, value in env.items() if is_secret_entry(name, value)}
    missing = [n for n in inherit if n not in os.environ and n not in out]
    if missing:
        raise ConfigError(
            f"cluster.env_inherit names {missing[0]}, which is not set in this shell: `export {missing[0]}=...` "
            f"(or read it without echo: `read -rs {missing[0]} && export {missing[0]}`), then run the command again"
        )
    return out


@contextlib.contextmanager
def applied_env(values: dict[str, Optional[str]]) -> Iterator[None]:
    """Set (None: unset) these variables in this process's environment meanwhile, then restore them."""
    saved = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, old in saved.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old


def submission_env(
    env: Mapping[str, Optional[str]], inherit: Sequence[str] = ()
) -> contextlib.AbstractContextManager[None]:
    """Put secret cluster.env values into this process's environment while sbatch runs: Slurm's
    --export=ALL hands them to the jobs, and no file (sbatch script, log, pickle) holds them."""
    return applied_env(dict(secret_env(env, inherit)))


def task_env(env: Mapping[str, Optional[str]]) -> dict[str, Optional[str]]:
    """What cluster.env makes of a task's environment, as a Slurm task gets it: values as strings
    (references to this environment resolved), None unset, secrets given or taken from this shell."""
    out: dict[str, Optional[str]] = {k: None if v is None else resolve_refs(str(v)) for k, v in env.items()}
    out.update(secret_env(env))
    return out


def export_option(
    extra: dict[str, Any], env: Mapping[str, Optional[str]], inherit: Sequence[str] = ()
) -> dict[str, Any]:
    """sbatch_extra with the secrets' names (cluster.env's, cluster.env_inherit's and those its values
    refer to) added to a user's own --export list (the default, ALL, has them)."""
    names = [k for k, v in env.items() if is_secret_entry(k, v)] + list(inherit)
    names += [n for v in env.values() for n in env_refs(str(v or ""))]
    if "export" not in extra or not names:
        return extra
    listed = str(extra["export"]).split(",")
    return dict(extra, export=",".join(listed + [n for n in dict.fromkeys(names) if n not in listed]))


# `$NAME` / `${NAME}` in a script: a reference to a variable, the secret's place when NAME is secret-named.
_SHELL_REF = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)")


def holds_secret_place(text: str) -> bool:
    """Whether a record (as written: redacted) marks where a secret goes: a struck value, a
    `${oc.env:NAME}` reference, or a script's `${NAME}` of a secret-named variable."""
    if REDACTED in text or ENV_REF.search(text):
        return True
    return any(is_secret_name(name) for name in _SHELL_REF.findall(text))


def record_mode(folder: Path, text: str) -> Optional[int]:
    """The mode of a record written into folder: None (the umask decides) unless it marks a secret's
    place (holds_secret_place); then owner-only, 0600, so a redaction missed is read by no one else.
    In a group-private folder (output.private=group: 0750, no way in for others) 0640, so the
    group the run is shared with still reads it."""
    if not holds_secret_place(text):
        return None
    try:
        mode = folder.stat().st_mode
    except OSError:
        return 0o600
    return 0o640 if mode & stat.S_IXGRP and not mode & stat.S_IXOTH else 0o600


def private_mode(value: Any) -> Optional[str]:
    """output.private as None (umask decides), "user" (0700/0600) or "group" (0750/0640)."""
    if value in (False, None, "false", "False", "none"):
        return None
    if value in (True, "true", "True", "user"):
        return "user"
    if value == "group":
        return "group"
    raise ConfigError(f"output.private={value!r} is not one of: false, true (= user), user, group")


@contextlib.contextmanager
def private_umask(value: Any) -> Iterator[None]:
    """With output.private, everything this process (and a job it submits: Slurm keeps the
    submitter's umask) creates is user- or group-private whatever the user's umask."""
    mode = private_mode(value)
    if mode is None:
        yield
        return
    old = os.umask(PRIVATE[mode][0])
    try:
        yield
    finally:
        os.umask(old)


def make_private(path: Path, value: Any) -> None:
    """chmod DIR and what is already in it to the output.private modes (a DIR made before it was set)."""
    mode = private_mode(value)
    if mode is None or not path.is_dir():
        return
    dir_mode = PRIVATE[mode][1]
    if stat.S_IMODE(path.stat().st_mode) == dir_mode:
        return  # already private: nothing inside can be reached by others
    file_mode = dir_mode & 0o666
    for root, _dirs, files in os.walk(path):  # os.walk does not descend into symlinked folders
        os.chmod(root, dir_mode)
        for name in files:
            p = os.path.join(root, name)
            if not os.path.islink(p):
                os.chmod(p, file_mode)


def remove_path(path: Path, ignore_errors: bool = False) -> None:
    """Delete a file or folder of ours; a symlink is unlinked, its target never touched."""
    try:
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path)  # rmtree unlinks symlinks inside, never follows them
    except OSError:
        if not ignore_errors:
            raise


def keep_restriction(made: Path, sources: list[Path]) -> Optional[str]:
    """What is made from the input (DIR/input) keeps the input's restriction: group or other
    permissions no input file grants are taken away from it, whatever the umask; says so."""
    try:
        granted = 0
        for src in sources:
            granted |= src.stat().st_mode
    except OSError:
        return None  # a hub dataset or a glob that moved: nothing to compare with
    taken = 0
    for who, read in ((0o070, stat.S_IRGRP), (0o007, stat.S_IROTH)):
        if not granted & read:
            taken |= who
    if not sources or not taken or not made.exists():
        return None
    paths = [made] if made.is_file() else [made, *made.rglob("*")]
    for p in paths:
        if not p.is_symlink():
            os.chmod(p, stat.S_IMODE(p.stat().st_mode) & ~taken)
    return f"{made} is made {'user-private' if taken == 0o077 else 'private to your group'} as its input is"


def _others_can_reach(path: Path) -> bool:
    """Whether every folder above path lets every user through (o+x)."""
    return all(p.stat().st_mode & stat.S_IXOTH for p in path.parents)


def exposure_warning(run_path: Path, input_path: str) -> Optional[str]:
    """A warning when DIR is readable by every user but the input it was made from is not."""
    src = Path(input_path)
    try:
        if not src.exists():
            return None  # a hub dataset or a glob: nothing to compare with
        dir_open = _others_can_reach(run_path) and run_path.stat().st_mode & stat.S_IXOTH
        input_open = _others_can_reach(src) and src.stat().st_mode & stat.S_IROTH
    except OSError:
        return None
    if dir_open and not input_open:
        return (
            f"warning: {run_path} is readable by every user but {input_path} is not: "
            f"set output.private=true or chmod o-rx {run_path}"
        )
    return None
