"""validate's predictions against what the shared engine does with the same rows; fixes leave committed rows alone."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from support.corpus import BAD_ROWS, read_output, write_corpus, write_rows
from support.procs import run_cli
from support.runs import run_overrides as overrides

from batchinfer.config.compose import compose
from batchinfer.errors import RunDirError
from batchinfer.insight.token_stats import percentile
from batchinfer.insight.validate import validate
from batchinfer.launch.local import run_local


@pytest.mark.engine
def test_row_problems_become_error_rows_and_validate_predicts_them(
    tmp_path: Path, tiny_model_path: Path, engine: Any
) -> None:
    corpus = write_rows(tmp_path / "bad.jsonl", BAD_ROWS)
    ov = overrides(tiny_model_path, corpus, tmp_path / "run", "input.sampling_column=params")
    out = read_output(run_local(compose(ov), engine=engine).path)
    assert [r["id"] for r in out] == [r["id"] for r in BAD_ROWS]  # every row exactly once
    errors = {r["row"]: (r["error"]["kind"], r["error"]["message"]) for r in out if r["error"]}
    assert set(errors) == set(EXPECTED_ERRORS)
    for row, (kind, start) in EXPECTED_ERRORS.items():
        assert errors[row][0] == kind and errors[row][1].startswith(start), errors[row]
    assert out[7]["text"] and out[8]["text"]  # 42 and True formatted into the prompt

    report = validate(compose(ov))
    predicted = {
        ex["row"]: (kind, ex["message"])
        for kind, entry in report["error_rows"]["by_kind"].items()
        for ex in entry["examples"]
    }
    assert predicted == errors  # the same code builds the prompts: the same messages
    assert {k: e["count"] for k, e in report["error_rows"]["by_kind"].items()} == {
        "prompt": 5,
        "overlong": 1,
        "sampling": 1,
    }
    assert report["exit_code"] == 1 and report["would_run"] == 3 and report["stops"]["count"] == 0
    assert report["overlong"]["outcome"] == "1 row at or over max_model_len=128: error rows (kind overlong)"

    cut = validate(compose([*ov, "prompt.overlong=truncate_left"]))
    assert "overlong" not in cut["error_rows"]["by_kind"] and cut["overlong"]["rows"] == 1
    stop = validate(compose([*ov, "prompt.overlong=fail"]))
    assert stop["exit_code"] == 2 and stop["stops"]["by_kind"]["overlong"]["examples"][0]["row"] == 6


@pytest.mark.engine
def test_fixed_input_or_bad_config_leave_committed_rows_alone(
    tmp_path: Path, tiny_model_path: Path, engine: Any
) -> None:
    corpus = write_rows(tmp_path / "bad.jsonl", BAD_ROWS[:4])
    ov = overrides(tiny_model_path, corpus, tmp_path / "run")
    run_local(compose(ov), engine=engine)
    before = part_bytes(tmp_path / "run")
    assert before
    write_rows(corpus, [dict(r, text="fixed") for r in BAD_ROWS[:4]])
    with pytest.raises(RunDirError, match=r"made with a different config: input.fingerprint \("):
        run_local(compose(ov), engine=engine)
    res = run_cli(["run", *ov, "sampling.top_p=1.5"])
    assert res.returncode == 2
    assert "batchinfer: error: sampling.top_p=1.5 is out of range: it takes a number in (0, 1]" in res.stderr
    assert part_bytes(tmp_path / "run") == before


@pytest.mark.engine
def test_clean_corpus_validates_and_counts_like_vllm(tmp_path: Path, tiny_model_path: Path, engine: Any) -> None:
    corpus = tmp_path / "clean.jsonl"
    write_corpus(corpus, 60, seed=5, max_words=30)
    ov = overrides(tiny_model_path, corpus, tmp_path / "run", "prompt.system=Be brief", "prompt.template=Topic: {text}")
    out = read_output(run_local(compose(ov), engine=engine).path)
    vllm_counts = Counter(r["prompt_tokens"] for r in out)
    report = validate(compose(ov))
    pt = report["prompt_tokens"]
    assert report["exit_code"] == 0 and report["error_rows"]["count"] == 0 and report["would_run"] == 60
    assert pt["rows"] == 60 and pt["total"] == sum(r["prompt_tokens"] for r in out)
    assert (pt["min"], pt["max"]) == (min(vllm_counts), max(vllm_counts))
    assert [pt["p50"], pt["p90"], pt["p99"]] == [percentile(vllm_counts, q) for q in (0.5, 0.9, 0.99)]
    assert sum(b["rows"] for b in pt["histogram"]) == 60
    assert report["model"]["max_model_len"] == 128 and report["model"]["max_model_len_source"] == "model.max_model_len"


EXPECTED_ERRORS = {
    1: ("prompt", "row 1: field 'text' is null or missing"),
    2: ("prompt", "row 2: field 'text' is null or missing"),
    3: ("prompt", "row 3: field 'text' is a list, not a string, number or bool; to put JSON in a prompt, "),
    4: ("prompt", "row 4: field 'text' is an object (dict), not a string, number or bool; to put JSON in a "),
    5: ("prompt", "row 5: the prompt is empty (field 'text' is blank)"),
    6: ("overlong", "row 6: prompt has "),
    9: ("sampling", "row 9: field 'params' has unknown sampling keys ['bogus']"),
}


def part_bytes(run_dir: Path) -> dict[str, bytes]:
    """Committed rows' files: parts, and the compacted rows.* of finished shards."""
    files = sorted([*run_dir.glob("shards/*/part-*"), *run_dir.glob("shards/*/rows.*")])
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in files}


@pytest.mark.engine
def test_pooling_rows_validate_as_the_engine_runs_them(tmp_path: Path, minilm: Path, embed_engine: Any) -> None:
    """task=score on all-MiniLM-L6-v2 (a bi-encoder): validate predicts the run's error rows, with the
    same messages, and counts the tokens the engine was given."""
    from support.pooling import LONG

    good = [
        {"id": f"g{i}", "q": f"what is {w}?", "d": f"{w} is word number {i}"} for i, w in enumerate(["tea", "rain"])
    ]
    bad = [{"id": "blank", "q": "what?", "d": "  "}, {"id": "long", "q": "and this?", "d": LONG}]
    corpus = write_rows(tmp_path / "pairs.jsonl", [*good, *bad])
    texts = ["model=all-minilm-l6-v2", f"model.path={minilm}", "task=score", "task.query={q}", "task.document={d}"]
    ov = [*texts, f"input.path={corpus}", "input.id_column=id", "prompt.overlong=error_row"]
    out = read_output(run_local(compose([*ov, f"output.dir={tmp_path / 'run'}"]), engine=embed_engine).path)
    errors = {r["row"]: (r["error"]["kind"], r["error"]["message"]) for r in out if r["error"]}
    assert set(errors) == {2, 3}
    report = validate(compose(ov))
    predicted = {
        ex["row"]: (k, ex["message"]) for k, e in report["error_rows"]["by_kind"].items() for ex in e["examples"]
    }
    assert predicted == errors and report["exit_code"] == 1 and report["would_run"] == 2
    clean = validate(compose([*texts, f"input.path={write_rows(tmp_path / 'good.jsonl', good)}"]))
    assert clean["exit_code"] == 0
    assert clean["prompt_tokens"]["total"] == sum(r["prompt_tokens"] for r in out if not r["error"])
