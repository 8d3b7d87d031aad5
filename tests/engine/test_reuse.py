"""output.reuse through the real engine (the session's shared one): a grown corpus sends only its new
rows to the engine and keeps the old rows' answers byte for byte; a changed temperature reuses nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from support.corpus import assert_own_output, read_output, write_rows
from support.runs import run_overrides as overrides

from batchinfer.config.compose import compose
from batchinfer.insight.report import build_report
from batchinfer.launch.local import run_local

pytestmark = pytest.mark.engine

ANSWER = ["text", "finish_reason", "prompt_tokens", "output_tokens", "error", "request_digest"]
WORDS = ["dog", "fox", "hello", "world", "physics", "biology", "quick", "lazy"]


def rows_of(n: int, start: int = 0) -> list[dict[str, Any]]:
    """n rows whose texts differ (no two share a request): words picked by the row's number."""
    return [
        {"id": f"doc-{i:03d}", "text": " ".join(WORDS[(i >> k) % len(WORDS)] for k in (0, 3, 6)) + f" {i}"}
        for i in range(start, start + n)
    ]


def counting_adds(monkeypatch: pytest.MonkeyPatch, engine: Any) -> list[list[int]]:
    """The token ids of every request that reaches the engine from now on."""
    added: list[list[int]] = []
    add = engine.add

    def counted(request_id: str, token_ids: list[int], params: Any) -> None:
        added.append(list(token_ids))
        add(request_id, token_ids, params)

    monkeypatch.setattr(engine, "add", counted)
    return added


def test_reuse_sends_only_new_rows_and_keeps_old_answers_byte_for_byte(
    tmp_path: Path, tiny_model_path: Path, engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    old_rows, new_rows = rows_of(30), rows_of(8, start=30)
    first_corpus = write_rows(tmp_path / "first.jsonl", old_rows)
    first = run_local(
        compose(overrides(tiny_model_path, first_corpus, tmp_path / "first", "sharding.num_shards=2")), engine=engine
    )
    grown = write_rows(tmp_path / "grown.jsonl", old_rows + new_rows)
    added = counting_adds(monkeypatch, engine)
    second = run_local(
        compose(
            overrides(
                tiny_model_path, grown, tmp_path / "second", "sharding.num_shards=3", f"output.reuse={first.path}"
            )
        ),
        engine=engine,
    )
    assert len(added) == len(new_rows)  # the 30 old rows never reached the engine
    before = pq.read_table(first.path / "output.parquet")
    after = pq.read_table(second.path / "output.parquet")
    assert after.slice(0, 30).select(ANSWER).equals(before.select(ANSWER))  # the old answers, byte for byte
    out = read_output(second.path)
    assert [r["id"] for r in out] == [r["id"] for r in old_rows + new_rows]
    assert [r["reused"] for r in out] == [True] * 30 + [False] * 8
    for r, x in zip(out, old_rows + new_rows, strict=True):
        assert_own_output(r, x["text"])
    assert build_report(second)["totals"]["reused_rows"] == 30
    # the new rows' token ids are those the engine got: each new row's own request went, no other
    assert len({tuple(ids) for ids in added}) == len(new_rows)

    # a changed temperature (seeded, so identical requests could share) changes every request
    added.clear()
    warmer = run_local(
        compose(
            overrides(
                tiny_model_path,
                grown,
                tmp_path / "warmer",
                "sampling.temperature=0.8",
                "sampling.seed=1",
                f"output.reuse=[{first.path},{second.path}]",
            )
        ),
        engine=engine,
    )
    assert len(added) == len(old_rows + new_rows)
    assert not any(r["reused"] for r in read_output(warmer.path))
    assert build_report(warmer)["totals"]["reused_rows"] == 0
