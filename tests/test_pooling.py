"""Pooling tasks (embed, classify, score) on real vLLM with all-MiniLM-L6-v2 from its PyPI wheel."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from batchinfer.config.compose import compose

pytestmark = [pytest.mark.engine]
TEXTS = ["A fox is an animal.", "Paris is in France.", "What is a fox?", "A fox is an animal."]


@pytest.fixture(scope="module")
def minilm() -> Path:
    """all-MiniLM-L6-v2, unpacked once from its wheel into $BATCHINFER_HOME/models."""
    from batchinfer.models.locations import prepare_minilm

    return prepare_minilm()


@pytest.fixture(scope="module")
def embed_engine(minilm: Path) -> Iterator[Any]:
    """One pooling engine in this process for the module."""
    from batchinfer.engine.vllm_engine import Engine

    engine = Engine(compose(["model=all-minilm-l6-v2", f"model.path={minilm}", "task=embed"]))
    yield engine
    engine.close()


def _run(engine: Any, texts: list[str], params: Any) -> dict[str, Any]:
    """Texts through add/step, as the worker feeds them: request id -> Completion."""
    for i, t in enumerate(texts):
        engine.add(f"r{i}", engine.encode(t), params)
    done: dict[str, Any] = {}
    while engine.has_unfinished():
        done.update((c.request_id, c) for c in engine.step())
    return done


def test_embeddings_through_add_step_match_plain_vllm_embed(embed_engine: Any) -> None:
    assert embed_engine.max_model_len == 256 and "embed" in embed_engine.pooling_tasks
    done = _run(embed_engine, TEXTS, embed_engine.pooling_params("embed"))
    vectors = np.stack([done[f"r{i}"].pooled for i in range(len(TEXTS))])
    assert vectors.dtype == np.float32 and vectors.shape == (4, 384)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)  # the model's Normalize module
    plain = np.array([o.outputs.embedding for o in embed_engine.llm.embed(TEXTS, use_tqdm=False)], dtype=np.float32)
    np.testing.assert_allclose(vectors, plain, atol=1e-5)
    sims = vectors @ vectors.T
    assert sims[2, 0] > sims[2, 1] + 0.3 and sims[0, 3] == pytest.approx(1.0, abs=1e-5)  # fox with fox
    assert done["r0"].prompt_tokens == len(embed_engine.encode(TEXTS[0])) == 8  # [CLS] ... [SEP]


def test_pooling_params_refuse_what_the_model_cannot_do(embed_engine: Any) -> None:
    with pytest.raises(ValueError, match=r"the model runs .*embed.*, not classify"):
        embed_engine.pooling_params("classify")
    with pytest.raises(ValueError, match="dimensions"):  # all-MiniLM-L6-v2 is not a Matryoshka model
        embed_engine.pooling_params("embed", dimensions=128)
