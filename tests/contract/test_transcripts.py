"""Transcripts in the docs that a test can reproduce exactly: the command is run again here on the same
inputs and what it prints must be what the page shows (a `...` line stands for lines left out)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import tempfile
from pathlib import Path

import pytest
from support import REPO
from support.model_configs import LLAMA_70B
from support.procs import run_cli


def transcript_commands(page: Path, prefix: str) -> list[tuple[list[str], list[str]]]:
    """Each `$ batchinfer ...` command of PAGE's code blocks starting with PREFIX, with the lines it printed."""
    out: list[tuple[list[str], list[str]]] = []
    for block in re.findall(r"^```\n(.*?)^```", page.read_text(), re.S | re.M):
        lines = block.splitlines()
        i = 0
        while i < len(lines):
            if not lines[i].startswith("$ "):
                i += 1
                continue
            command = lines[i][2:]
            while command.endswith("\\"):  # a command continued on the next line
                i += 1
                command = command[:-1] + lines[i].strip()
            i += 1
            printed = []
            while i < len(lines) and not lines[i].startswith("$ "):
                printed.append(lines[i])
                i += 1
            if command.startswith(prefix):
                out.append((shlex.split(command)[1:], printed))
    return out


def shown_in(printed: list[str], real: list[str]) -> bool:
    """PRINTED (with `...` for lines left out) is REAL, in order; `...` matches any run of lines."""
    pattern = "".join(".*?" if ln == "..." else re.escape(ln + "\n") for ln in printed)
    return re.fullmatch(pattern, "".join(ln + "\n" for ln in real), re.S) is not None


LLAMA_70B_PLAN = "batchinfer plan model.path=/tmp/llama-3.3-70b"


def test_the_70b_plan_walkthrough_is_what_plan_prints() -> None:
    commands = transcript_commands(REPO / "docs" / "tune-forecast.md", LLAMA_70B_PLAN)
    assert len(commands) == 2  # the single-GPU plan and the --gpu all table
    # plan wraps its lines at a width, so the folder's path is as long as the page's /tmp/llama-3.3-70b
    parent = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        folder = parent / ("m" * (len("/tmp/llama-3.3-70b") - len(str(parent)) - 1))
        assert len(str(folder)) == len("/tmp/llama-3.3-70b") and folder.name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(LLAMA_70B))
        for args, printed in commands:
            res = run_cli([a.replace("/tmp/llama-3.3-70b", str(folder)) for a in args])
            assert res.returncode == 0, res.stderr
            real = res.stdout.replace(str(folder), "/tmp/llama-3.3-70b").splitlines()
            assert shown_in(printed, real), "\n".join(["page:", *printed, "plan prints:", *real])
    finally:
        shutil.rmtree(parent)


@pytest.mark.parametrize(
    ("printed", "real", "ok"),
    [
        (["a", "...", "d"], ["a", "b", "c", "d"], True),
        (["a", "c"], ["a", "b", "c"], False),
        (["...", "c"], ["a", "b", "c"], True),
        (["a", "x"], ["a", "b"], False),
    ],
)
def test_shown_in_needs_every_shown_line_in_order(printed: list[str], real: list[str], ok: bool) -> None:
    assert shown_in(printed, real) is ok
