"""`${oc.env:NAME}` references: how a record refers to a secret variable, and where they are resolved
(a task, an engine's environment) or turned into the shell's `${NAME}` (an sbatch script's line)."""

from __future__ import annotations

import os
import re

ENV_REF = re.compile(r"\$\{oc\.env:([A-Za-z_][A-Za-z0-9_]*)(?:,[^}]*)?\}")


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
