"""Shared-cluster safety: secret names, the environment secrets travel in, modes of DIR, safe removal."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

from batchinfer.errors import ConfigError

# Whole word parts only: `max_tokens`, `sort_keys`, `tokenizer` and `keep` are not secrets.
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
        "passphrase",
        "credential",
        "credentials",
        "auth",
        "authorization",
    }
)
# Word parts of snake_case, kebab-case, dotted and camelCase names (HFToken -> HF, Token).
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")
REDACTED = "<redacted>"
# Config subtrees that hold row data (few-shot examples), not settings: their field names are the user's columns.
ROW_DATA = ("prompt.examples",)
PRIVATE = {"user": (0o077, 0o700), "group": (0o027, 0o750)}  # umask, DIR mode


# Environment variables written as one word (PGPASSWORD, HFTOKEN): a secret word at the end.
SECRET_SUFFIXES = ("token", "password", "passwd", "passphrase", "secret", "apikey", "credential", "credentials")


def is_secret_name(name: str) -> bool:
    """Whether a config key or environment variable name looks like it holds a secret."""
    parts = _WORD.findall(str(name))
    if any(part.lower() in SECRET_WORDS for part in parts):
        return True
    return any(part.isupper() and part.lower().endswith(SECRET_SUFFIXES) for part in parts)


# NAME=value in a shell line, the value given (not $NAME or ${NAME}): what cluster.setup stores.
_ASSIGNMENT = re.compile(r"(?<![\w$])([A-Za-z_][A-Za-z0-9_]*)=(?![\s$\"']*\$)([^\s;&|]+)")


def check_config_secrets(c: dict[str, Any]) -> None:
    """Refuse secret-named values outside cluster.env: everything else is stored in DIR/run.yaml."""
    cluster = c.get("cluster") or {}
    lines = [(f"cluster.setup[{i}]", line) for i, line in enumerate(cluster.get("setup") or [])]
    lines += [(f"cluster.sbatch_extra.{k}", v) for k, v in (cluster.get("sbatch_extra") or {}).items()]
    for where, line in lines:
        for name, _ in _ASSIGNMENT.findall(str(line)):
            if is_secret_name(name):
                raise ConfigError(
                    f"{where} sets {name}, which looks like a secret, and the config is stored in DIR/run.yaml "
                    f"(and the sbatch script in DIR/logs) where others may read it. `export {name}=...` before "
                    f"running batchinfer (Slurm passes your environment to the jobs), or pass it as "
                    f"cluster.env.{name}=..., which is never stored"
                )
    for key in _secret_keys(c, ""):
        raise ConfigError(
            f"{key} looks like a secret, and the config is stored in DIR/run.yaml where others may read it. "
            f"Put it in the environment instead (e.g. `export HF_TOKEN=...` before running batchinfer: "
            f"Slurm passes your environment to the jobs), or as cluster.env.NAME, which is never stored"
        )


def _secret_keys(node: Any, prefix: str) -> Iterator[str]:
    if prefix in ROW_DATA or prefix == "cluster.env" or not isinstance(node, dict):
        return
    for k, v in node.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if is_secret_name(k) and v not in (None, "", REDACTED):
            yield key
        yield from _secret_keys(v, key)


def redact_env(env: dict[str, Any]) -> dict[str, Any]:
    """cluster.env as stored: secret-named values replaced by <redacted> (the name stays)."""
    return {k: REDACTED if is_secret_name(k) and v not in (None, "") else v for k, v in env.items()}


def redact_config(c: dict[str, Any]) -> dict[str, Any]:
    """A copy of a resolved config safe to store or print."""
    cluster = c.get("cluster") or {}
    if not cluster.get("env"):
        return c
    return dict(c, cluster=dict(cluster, env=redact_env(cluster["env"])))


def secret_env(env: dict[str, Any]) -> dict[str, str]:
    """The secret cluster.env values to pass through the environment of sbatch: given values, or
    (for <redacted> ones, e.g. at resume) the submitting shell's own."""
    out = {}
    for name, value in env.items():
        if not is_secret_name(name) or value is None:
            continue
        if value == REDACTED:
            if name not in os.environ:
                raise ConfigError(
                    f"cluster.env.{name} is a secret, and secrets are not stored in DIR: `export {name}=...` "
                    f"in this shell (or pass cluster.env.{name}=... again), then run the command again"
                )
            value = os.environ[name]
        out[name] = str(value)
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


def submission_env(env: dict[str, Any]) -> contextlib.AbstractContextManager[None]:
    """Put secret cluster.env values into this process's environment while sbatch runs: Slurm's
    --export=ALL hands them to the jobs, and no file (sbatch script, log, pickle) holds them."""
    return applied_env(dict(secret_env(env)))


def task_env(env: dict[str, Any]) -> dict[str, Optional[str]]:
    """What cluster.env makes of a task's environment, as a Slurm task gets it: values as strings,
    None unset, secrets given or taken from this shell (see secret_env)."""
    out: dict[str, Optional[str]] = {k: None if v is None else str(v) for k, v in env.items()}
    out.update(secret_env(env))
    return out


def export_option(extra: dict[str, Any], env: dict[str, Any]) -> dict[str, Any]:
    """sbatch_extra with secret names added to a user's own --export list (the default, ALL, has them)."""
    names = [k for k in env if is_secret_name(k) and env[k] is not None]
    if "export" not in extra or not names:
        return extra
    listed = str(extra["export"]).split(",")
    return dict(extra, export=",".join(listed + [n for n in names if n not in listed]))


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
