"""States a redo's passes can be left in, on the stand-in engine: a pass whose every row a later pass
answered again, a finished pass never merged into DIR, an unfinished local pass and
`resume --dry-run`, and redo on an OpenAI Batch input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.corpus import read_output, write_corpus
from support.fake_slurm import cli
from support.openai_batch import request
from support.runs import model_overrides, run_overrides
from support.standin import StandinEngine, standin_env

from batchinfer.config.compose import compose
from batchinfer.errors import RunDirError
from batchinfer.launch.local import run_local
from batchinfer.launch.redo import new_pass, redo
from batchinfer.rundir import passes
from batchinfer.rundir.store import RunDir

LENGTH = 'finish_reason == "length"'


@pytest.fixture
def done(tmp_path: Path, tiny_model_path: Path) -> dict[str, Any]:
    """A finished run of 80 rows at max_tokens=4 in 3 shards on the stand-in."""
    corpus = tmp_path / "c.jsonl"
    rows = write_corpus(corpus, 80, seed=11)
    ov = run_overrides(tiny_model_path, corpus, tmp_path / "run", "sampling.max_tokens=4", "sharding.num_shards=3")
    cfg = compose(ov)
    run = run_local(cfg, engine=StandinEngine(cfg))
    return {"run": run, "cfg": cfg, "ov": ov, "rows": rows}


def test_a_pass_whose_rows_a_later_pass_all_answered_again_stays_merged(
    done: dict[str, Any], capsys: pytest.CaptureFixture
) -> None:
    run, cfg = done["run"], done["cfg"]
    redo(str(run.path), LENGTH, ["sampling.max_tokens=5"], engine=StandinEngine(cfg))
    first = [r["row"] for r in read_output(run.path) if r["pass"] == 1]
    assert first
    # pass 2 answers every row of pass 1 again (and what still stops at length)
    again = f"pass == 1 or {LENGTH}"
    redo(str(run.path), again, ["sampling.max_tokens=6"], engine=StandinEngine(cfg))
    out = read_output(run.path)
    assert not [r for r in out if r["pass"] == 1] and [r["row"] for r in out if r["pass"] == 2] == first
    stats = json.loads(run.stats_json.read_text())
    assert stats["passes"] == {"0": 80 - len(first), "2": len(first)}  # rows per pass, as before
    assert passes.output_is_current(run)
    code, text, _ = cli(["status", str(run.path)], capsys)
    assert code == 0 and "pass 1: merged" in text and "pass 2: merged" in text
    # the same command again makes a pass of the rows that still match
    still = [r["row"] for r in out if r["finish_reason"] == "length"]
    assert still
    redo(str(run.path), again, ["sampling.max_tokens=6"], engine=StandinEngine(cfg))
    assert passes.read_record(passes.pass_path(run, 3)).rows == len(still)
    assert [r["row"] for r in read_output(run.path) if r["pass"] == 3] == still


def hold_merge_lock(run: RunDir) -> subprocess.Popen:
    """Another process holding DIR's merge lock until its stdin closes."""
    code = (
        "import sys\nfrom pathlib import Path\nfrom batchinfer.locks import RunLock\n"
        f"with RunLock(Path({str(run.path)!r}), mode='auto'):\n    print('held', flush=True)\n    sys.stdin.read()\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"  # type: ignore[union-attr]
    return holder


@pytest.mark.parametrize("then", ["run", "resume"])
def test_a_finished_pass_whose_merge_into_dir_was_refused_is_merged_by_run_and_resume(
    done: dict[str, Any], capsys: pytest.CaptureFixture, then: str
) -> None:
    run, cfg = done["run"], done["cfg"]
    before = run.output_path.read_bytes()
    holder = hold_merge_lock(run)  # a `batchinfer merge DIR` typed meanwhile
    try:
        with pytest.raises(RunDirError, match=rf"is being merged by host \S+ pid {holder.pid}"):
            redo(str(run.path), LENGTH, ["sampling.max_tokens=9"], engine=StandinEngine(cfg))
    finally:
        holder.communicate("", timeout=30)
    assert passes.is_finished(passes.pass_path(run, 1)) and run.output_path.read_bytes() == before
    if then == "run":
        code, out, err = cli(["run", *done["ov"]], capsys)
        assert code == 0, err
        assert "already complete" not in out
    else:
        code, out, err = cli(["resume", str(run.path)], capsys)
        assert code == 0, err
        assert "nothing to resume" not in out
    after = read_output(run.path)
    assert [r["row"] for r in after if r["pass"] == 1] == passes.source_rows(RunDir(passes.pass_path(run, 1))).tolist()
    assert [r["id"] for r in after] == [r["id"] for r in done["rows"]]


def test_resume_dry_run_never_runs_an_unfinished_local_pass(
    done: dict[str, Any], capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = done["run"]
    before = run.output_path.read_bytes()
    new_pass(run, LENGTH, ["sampling.max_tokens=9"])  # prepared, not run (a redo killed before its first commit)
    for k, v in standin_env().items():  # were it run, the stand-in answers (not vLLM on this node)
        monkeypatch.setenv(k, v)
    code, out, err = cli(["resume", "--dry-run", str(run.path)], capsys)
    assert code == 0, err
    pass_dir = passes.pass_path(run, 1)
    assert "pass 1" in out and "dry run" in out
    assert not list(pass_dir.glob("shards/*/part-*")) and not list(pass_dir.glob("shards/*/DONE.json"))
    assert run.output_path.read_bytes() == before


def test_redo_on_an_openai_batch_input(tmp_path: Path, tiny_model_path: Path) -> None:
    lines = "".join(
        request(f"req-{i}", {"model": "m", "messages": [{"role": "user", "content": f"say {w} {i}"}]})
        for i, w in enumerate(["dog", "fox", "hello", "world", "quick", "lazy"] * 3)
    )
    (tmp_path / "batch.jsonl").write_text(lines)
    ov = [f"input.path={tmp_path}/batch.jsonl", f"output.dir={tmp_path}/run", "sampling.max_tokens=4"]
    ov += model_overrides(tiny_model_path)
    cfg = compose(ov)
    run = run_local(cfg, engine=StandinEngine(cfg))
    before = [json.loads(line) for line in run.output_path.read_text().splitlines()]
    length = [r["custom_id"] for r in before if r["response"]["body"]["choices"][0]["finish_reason"] == "length"]
    assert length
    redo(str(run.path), LENGTH, ["sampling.max_tokens=9"], engine=StandinEngine(cfg))
    after = [json.loads(line) for line in run.output_path.read_text().splitlines()]
    assert [r["custom_id"] for r in after] == [r["custom_id"] for r in before]
    answer = lambda r: (r["response"]["body"]["choices"], r["response"]["body"]["usage"])  # noqa: E731
    changed = [a["custom_id"] for a, b in zip(after, before, strict=True) if answer(a) != answer(b)]
    assert changed == length  # answered again with up to 9 tokens; the others as they were
