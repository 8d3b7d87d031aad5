"""One owner for every folder (issue 40): only ownership.py (with security.remove_path, the one
remover that never follows a symlink) removes a folder, and only the modules below, each writing
its own files inside a folder it holds, unlink, rename or remove anything. A new `shutil.rmtree`,
`remove_path`, `unlink`, `os.replace` or `Path.rename` anywhere else fails here: make or remove the
folder through ownership.py (claim, stage, publish, Claim.remove), or say here why the module's
own files inside a held folder need it. The checker is a plain function, also run on a small
synthetic package to show that it reports what it looks for."""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterator
from pathlib import Path

from support import REPO

PACKAGE = "batchinfer"
# Removing a folder (whole trees): the one home and its primitive.
FOLDER_REMOVERS = {"batchinfer.ownership", "batchinfer.security"}
# The exemption rule: a module that writes, replaces or removes its OWN files (or its own
# temporary folder) inside a folder held by a claim or a lock, named with that folder and holder.
OWN_FILES = {
    "batchinfer.ownership": "the one home: marks, staged folders, what a claim made",
    "batchinfer.security": "remove_path, the remover that unlinks a symlink and never follows it",
    "batchinfer.durable": "a file's temporary, renamed into place or unlinked (any writer's)",
    "batchinfer.locks.lock": "the lock's own file, under that lock",
    "batchinfer.locks.lockfile": "the lock file, its temporaries and takeover markers",
    "batchinfer.locks.filesystems": "flock and clock probes it made an instant before",
    "batchinfer.rundir.shard_folder": "a shard's parts and spills, under the shard lock",
    "batchinfer.rundir.merge": "the merge's temporaries and MERGING marker, under the merge lock",
    "batchinfer.rundir.output_swap": "DIR's output and its temporaries, under the merge lock",
    "batchinfer.rundir.output_writer": "DIR/output staged and swapped in, under the merge lock",
    "batchinfer.rundir.prepare": "DIR/input and its write probe, under prepare's claim of DIR",
    "batchinfer.inputs.convert": "DIR/input's temporaries and cache, under prepare's claim of DIR",
    "batchinfer.inputs.jsonl_stream": "DIR/input's temporary, under prepare's claim of DIR",
    "batchinfer.tune.results": "tune.json written whole, under the tune's claim of its folder",
    "batchinfer.tune.job": "job.json written whole, under the tune's claim of its folder",
    "batchinfer.engine.shm": "the engine's own /dev/shm segments it recorded, once it stopped (no run folder)",
}
TREE = ("rmtree", "rmdir", "removedirs")  # remove a folder
ANY = ("unlink", "remove_path")  # remove a file or (remove_path) a folder
OS_ONLY = ("remove", "rename", "replace", "renames")  # os.<name>(...)


def removals(tree: ast.Module) -> Iterator[tuple[int, str, bool]]:
    """(line, call, removes a folder) of every call that removes or renames a path."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
        owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else None
        if name in TREE or name in ANY and (isinstance(f, ast.Attribute) or name == "remove_path"):
            yield node.lineno, name, name in TREE
        elif isinstance(f, ast.Attribute) and name in OS_ONLY and owner == "os":
            yield node.lineno, f"os.{name}", False
        elif isinstance(f, ast.Attribute) and name in ("rename", "replace"):
            one_path = len(node.args) == 1 and not node.keywords  # Path.rename(target); str.replace takes two
            if one_path and not isinstance(f.value, ast.Constant):
                yield node.lineno, f".{name}", False


def offenders(src: Path, package: str, own_files: dict[str, str], folder_removers: set[str]) -> list[str]:
    """`file:line: call` of each removal or rename outside the allowed modules."""
    out = []
    for path in sorted((src / package).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        for line, call, folder in removals(ast.parse(path.read_text(), str(path))):
            if (folder and module not in folder_removers) or module not in own_files:
                out.append(f"{path.relative_to(src)}:{line}: {call}")
    return out


def test_only_the_one_home_removes_or_renames_a_run_s_folders() -> None:
    found = offenders(REPO, PACKAGE, OWN_FILES, FOLDER_REMOVERS)
    assert not found, (
        "a path removed or renamed outside ownership.py and the modules that write their own files "
        "inside a held folder (tests/contract/test_ownership_rule.py):\n" + "\n".join(found)
    )


def test_every_exempt_module_exists() -> None:
    for module in OWN_FILES:
        path = REPO / Path(*module.split("."))
        assert path.with_suffix(".py").is_file() or (path / "__init__.py").is_file(), module


def test_the_checker_reports_what_it_looks_for(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "bad.py").write_text(
        textwrap.dedent(
            """
            import os, shutil
            from pathlib import Path
            from x import remove_path
            def f(d: Path) -> None:
                shutil.rmtree(d)
                d.rmdir()
                (d / "a").unlink()
                os.replace(d, d.parent / "b")
                d.rename(d.parent / "c")
                remove_path(d)
                os.remove(d)
            def g(s: str, items: list) -> str:
                items.remove(1)  # a list's, not a path's
                return s.replace("a", "b") + "x".replace("y")
            """
        )
    )
    (pkg / "writer.py").write_text("import shutil, os\ndef f(p):\n    os.replace(p, p)\n    shutil.rmtree(p)\n")
    found = offenders(tmp_path, "pkg", {"pkg.writer": "its own files"}, set())
    assert found == [
        "pkg/bad.py:6: rmtree",
        "pkg/bad.py:7: rmdir",
        "pkg/bad.py:8: unlink",
        "pkg/bad.py:9: os.replace",
        "pkg/bad.py:10: .rename",
        "pkg/bad.py:11: remove_path",
        "pkg/bad.py:12: os.remove",
        "pkg/writer.py:4: rmtree",  # its own files, yes; a folder, never
    ]
