"""A pooling row the engine refuses becomes an error row of the kind that says why: `overlong` only
for a pair that cannot be cut to the window, `rejected` for anything else (issue 26)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from support.runs import fake_model_dir

from batchinfer.config.compose import compose
from batchinfer.config.schema import to_config
from batchinfer.engine.pooled import PoolingRows
from batchinfer.requests.prompts import PromptBuilder, RowError


class RefusingPoolingEngine:
    """Pooling engine surface of a cross-encoder: encode refuses one text; encode_pair cannot cut one pair."""

    max_model_len = 16
    pooling_tasks = ("classify",)

    def encode(self, prompt: Any, kwargs: Any = None) -> list[int]:
        if "bad" in str(prompt):
            raise ValueError("the tokenizer refuses this text")
        return [1, *range(10, 10 + len(str(prompt).split())), 2]

    def encode_pair(self, query: str, document: str, limit: Any = None) -> tuple[list[int], int]:
        ids = [1] * (len(query.split()) + len(document.split()) + 3)
        if limit is not None:
            raise RowError("overlong", f"the pair cannot be cut to {limit} tokens: the query alone is longer")
        return ids, 2

    def pooling_params(self, task: str, dimensions: Any = None, extras: str = "") -> Any:
        return None


def rows_of(tmp_path: Path, *overrides: str) -> PoolingRows:
    cfg = to_config(compose([f"model.path={fake_model_dir(tmp_path)}", *overrides]))
    return PoolingRows(cfg, PromptBuilder(cfg.prompt))


def test_a_refused_text_is_rejected_and_a_pair_too_long_to_cut_is_overlong(tmp_path: Path) -> None:
    embed = rows_of(tmp_path, "task=embed")
    got = embed.request(0, {"id": "a"}, {"text": "a bad text"}, RefusingPoolingEngine()).row
    assert got["error"]["kind"] == "rejected" and "the tokenizer refuses this text" in got["error"]["message"]
    score = rows_of(tmp_path, "task=score", "task.query={q}", "task.document={d}", "prompt.overlong=truncate_right")
    long = {"q": " ".join(["w"] * 20), "d": "doc"}
    got = score.request(1, {"id": "b"}, long, RefusingPoolingEngine()).row
    assert got["error"]["kind"] == "overlong" and "cannot be cut to 16 tokens" in got["error"]["message"]
