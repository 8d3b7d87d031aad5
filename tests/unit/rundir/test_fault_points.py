"""Fault points are named by constants of batchinfer.faults at every call site (so grep finds
each point's places): no name assembled at run time, every constant in faults.POINTS, and every
point in POINTS used by some call site (issue 28)."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

from support import REPO

from batchinfer import faults


def fault_constants() -> dict[str, tuple[str, ...]]:
    """Each public constant of faults naming fault points -> the points it names (a WritePoints
    names three)."""
    out: dict[str, tuple[str, ...]] = {}
    for name, value in vars(faults).items():
        if not name.isupper() or name == "POINTS":
            continue
        if isinstance(value, faults.WritePoints):
            out[name] = tuple(value)
        elif isinstance(value, str) and "-" in value and not value.startswith("BATCHINFER_"):
            out[name] = (value,)
    return out


def scan(package: Path) -> tuple[list[str], set[str]]:
    """(each `faults.point(...)` call whose name is a literal or built at run time, as `file:line`;
    the names of faults' constants the package refers to as `faults.NAME` outside faults.py)."""
    assembled, used = [], set()
    for path in sorted(package.rglob("*.py")):
        if path.name == "faults.py" and path.parent == package:
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "faults":
                if node.attr.isupper():
                    used.add(node.attr)
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "point"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "faults"
                and node.args
                and isinstance(node.args[0], (ast.Constant, ast.JoinedStr, ast.BinOp, ast.Call))
            ):
                assembled.append(f"{path.relative_to(package.parent)}:{node.lineno}")
    return assembled, used


def test_every_fault_constant_is_a_point_and_every_point_has_one() -> None:
    constants = fault_constants()
    named = {p for points in constants.values() for p in points}
    assert named <= set(faults.POINTS), sorted(named - set(faults.POINTS))
    assert set(faults.POINTS) <= named, sorted(set(faults.POINTS) - named)
    assert len(set(faults.POINTS)) == len(faults.POINTS)
    # A write's points are its own: in-X-write, before-X-rename, after-X-rename.
    for points in (faults.PART_WRITE, faults.COMPACT_WRITE):
        stem = points.in_write.removeprefix("in-").removesuffix("-write")
        assert points == (f"in-{stem}-write", f"before-{stem}-rename", f"after-{stem}-rename")


def test_every_call_site_names_its_point_by_a_constant_and_every_point_is_used() -> None:
    assembled, used = scan(REPO / "batchinfer")
    assert not assembled, "fault points named by a literal or built at run time: " + ", ".join(assembled)
    reached = {p for name in used & set(fault_constants()) for p in fault_constants()[name]}
    assert set(faults.POINTS) <= reached, f"points no call site uses: {sorted(set(faults.POINTS) - reached)}"


def test_the_scan_finds_assembled_names_and_constants(tmp_path: Path) -> None:
    """The checker on a small package: a name built at run time and a literal are reported, a
    constant is counted as used."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "a.py").write_text(
        textwrap.dedent(
            """
            from batchinfer import faults

            def f(prefix):
                faults.point(f"after-{prefix}-rename")
                faults.point("in-merge")
                faults.point(faults.IN_MERGE_SWAP)
                publish(faults.PART_WRITE)
            """
        )
    )
    assembled, used = scan(package)
    assert assembled == ["pkg/a.py:5", "pkg/a.py:6"]
    assert used == {"IN_MERGE_SWAP", "PART_WRITE"}
