"""LoRA adapters without an engine: config refusals, the row verdict (kind adapter), engine
arguments from the adapters' configs, request identity per adapter, a changed adapter refused."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from support.corpus import read_output, write_rows
from support.fake_engine import FakeEngine, fake_overrides, keyed
from support.runs import fake_model_dir, model_overrides

from batchinfer.config.compose import compose
from batchinfer.config.schema import to_config
from batchinfer.engine.engine_args import llm_kwargs, model_key
from batchinfer.errors import ConfigError, RunDirError
from batchinfer.launch.local import run_shards
from batchinfer.models.lora import adapter_ids
from batchinfer.requests.request import RequestKey
from batchinfer.rundir.merge import merge
from batchinfer.rundir.model_record import check_model_unchanged
from batchinfer.rundir.prepare import prepare


def adapter(parent: Path, name: str, r: int) -> Path:
    """A PEFT adapter folder as far as batchinfer reads it without an engine (config, weight bytes)."""
    d = parent / name
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": 2 * r}))
    (d / "adapter_model.safetensors").write_bytes(name.encode() * 10)
    return d


@pytest.fixture
def adapters(tmp_path: Path) -> list[str]:
    a, b = adapter(tmp_path, "alpha", 4), adapter(tmp_path, "beta", 16)
    return [f"+model.lora.adapters.alpha={a}", f"+model.lora.adapters.beta={b}"]


ROWS = [
    {"id": "r0", "text": "one", "task": "alpha"},
    {"id": "r1", "text": "one", "task": "beta"},
    {"id": "r2", "text": "one", "task": None},
    {"id": "r3", "text": "two", "task": "gamma"},
    {"id": "r4", "text": "one", "task": "alpha"},
]


def test_unknown_default_is_refused_naming_the_known_ones(tmp_path: Path, adapters: list[str]) -> None:
    with pytest.raises(ConfigError, match=r"model.lora.default='gamma' .*known: alpha, beta"):
        compose([*adapters, "model.lora.default=gamma", f"output.dir={tmp_path / 'run'}"])
    assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match="input.adapter_column='task' needs model.lora.adapters"):
        compose(["input.adapter_column=task"])


def test_adapter_without_rank_is_refused_naming_its_file(tmp_path: Path) -> None:
    d = tmp_path / "bad"
    d.mkdir()
    with pytest.raises(ConfigError, match=rf"model.lora.adapters.bad: cannot read {d}/adapter_config.json"):
        compose([f"+model.lora.adapters.bad={d}"])


def test_engine_arguments_come_from_the_adapters(adapters: list[str]) -> None:
    kw = llm_kwargs(to_config(compose(adapters)))
    assert (kw["enable_lora"], kw["max_loras"], kw["max_lora_rank"]) == (True, 2, 16)
    kw = llm_kwargs(to_config(compose([*adapters, "model.lora.max_loras=1", "model.lora.max_lora_rank=32"])))
    assert (kw["max_loras"], kw["max_lora_rank"]) == (1, 32)
    assert "enable_lora" not in llm_kwargs(to_config(compose([])))
    assert adapter_ids({"beta": "b", "alpha": "a"}) == {"alpha": 1, "beta": 2}


def test_request_identity_includes_the_adapter() -> None:
    base = RequestKey((1, 2, 3), "")
    assert base.digest() == RequestKey((1, 2, 3), "", None, None).digest()
    assert (
        len(
            {
                base.digest(),
                RequestKey((1, 2, 3), "", None, "a").digest(),
                RequestKey((1, 2, 3), "", None, "b").digest(),
            }
        )
        == 3
    )


def test_rows_get_their_adapter_and_unknown_names_are_error_rows(tmp_path: Path, adapters: list[str]) -> None:
    corpus = write_rows(tmp_path / "c.jsonl", ROWS)
    ov = fake_overrides(
        tmp_path, corpus, "input.id_column=id", "input.adapter_column=task", "model.lora.default=beta", *adapters
    )
    run = prepare(compose(ov))
    eng = keyed(FakeEngine(), run)
    run_shards(run, [0], engine=eng)
    merge(run)
    out = {r["id"]: r for r in read_output(run.path)}
    ids = eng.ids("one")
    assert [out[i]["adapter"] for i in ("r0", "r1", "r2", "r4")] == ["alpha", "beta", "beta", "alpha"]
    assert out["r0"]["text"] == out["r4"]["text"] == FakeEngine.answer(ids, "alpha")
    assert out["r1"]["text"] == out["r2"]["text"] == FakeEngine.answer(ids, "beta") != out["r0"]["text"]
    err = out["r3"]["error"]
    assert out["r3"]["text"] is None and err["kind"] == "adapter", err
    assert "'gamma'" in err["message"] and "alpha, beta" in err["message"] and "row 3" in err["message"]
    assert sorted(eng.adapters.values()) == ["alpha", "beta"]  # the two identical requests per adapter ran once


def test_changed_adapter_is_refused_on_resume_naming_it(tmp_path: Path, adapters: list[str]) -> None:
    corpus = write_rows(tmp_path / "c.jsonl", ROWS[:3])
    ov = fake_overrides(tmp_path, corpus, "input.id_column=id", "input.adapter_column=task", *adapters)
    run = prepare(compose(ov))
    (tmp_path / "beta" / "adapter_model.safetensors").write_bytes(b"retrained")
    beta = re.escape(f"LoRA adapter beta (model.lora.adapters.beta={tmp_path / 'beta'}) is not the one")
    with pytest.raises(RunDirError, match=rf"{beta}.*lora/beta/adapter_model.safetensors changed size") as e:
        check_model_unchanged(run)
    assert "the model folder" not in str(e.value)  # the base model did not change: not named (attack42)
    with pytest.raises(RunDirError, match=beta):
        prepare(compose(ov))


def test_an_adapter_behind_a_symlink_retargeted_is_named_with_where_it_leads(
    tmp_path: Path, adapters: list[str]
) -> None:
    corpus = write_rows(tmp_path / "c.jsonl", ROWS[:3])
    link = tmp_path / "alink"
    link.symlink_to(tmp_path / "alpha")
    mine = [a.replace(str(tmp_path / "alpha"), str(link)) for a in adapters]
    assert mine != adapters
    ov = fake_overrides(tmp_path, corpus, "input.id_column=id", "input.adapter_column=task", *mine)
    run = prepare(compose(ov))
    link.unlink()
    link.symlink_to(tmp_path / "beta")  # the same name, another adapter's weights
    with pytest.raises(RunDirError) as e:
        check_model_unchanged(run)
    said = str(e.value)
    assert f"LoRA adapter alpha (model.lora.adapters.alpha={link}, a symlink to {tmp_path / 'beta'})" in said, said
    assert "the model folder" not in said


def test_null_adapter_without_default_is_the_base_model(tmp_path: Path, adapters: list[str]) -> None:
    corpus = write_rows(tmp_path / "c.jsonl", ROWS[:3])
    run = prepare(
        compose(fake_overrides(tmp_path, corpus, "input.id_column=id", "input.adapter_column=task", *adapters))
    )
    eng = keyed(FakeEngine(), run)
    run_shards(run, [0], engine=eng)
    merge(run)
    out = read_output(run.path)
    ids = eng.ids("one")
    assert [r["adapter"] for r in out] == ["alpha", "beta", None] and all(r["error"] is None for r in out)
    assert out[2]["text"] == FakeEngine.answer(ids) not in (out[0]["text"], out[1]["text"])


def changes(seq: list) -> int:
    """How often consecutive items differ."""
    return sum(a != b for a, b in zip(seq, seq[1:], strict=False))


def interleaved(tmp_path: Path, adapters: list[str]) -> tuple[list[dict], list[str]]:
    """40 rows asking for alpha, beta, gamma and the base model interleaved, and their overrides."""
    gamma = adapter(tmp_path, "gamma", 8)
    names = ["alpha", None, "beta", "gamma", "beta", "alpha", None, "gamma"]
    rows = [{"id": f"r{i}", "text": f"text {i}", "task": names[i % len(names)]} for i in range(40)]
    corpus = write_rows(tmp_path / "c.jsonl", rows)
    ov = fake_overrides(
        tmp_path,
        corpus,
        "input.id_column=id",
        "input.adapter_column=task",
        *adapters,
        f"+model.lora.adapters.gamma={gamma}",
    )
    return rows, ov


def test_rows_go_adapter_by_adapter_never_more_adapters_in_flight_than_slots(
    tmp_path: Path, adapters: list[str]
) -> None:
    rows, ov = interleaved(tmp_path, adapters)
    run = prepare(compose([*ov, "model.lora.max_loras=1"]))
    eng = keyed(FakeEngine(), run)
    eng.max_loras = 1
    run_shards(run, [0], engine=eng)
    merge(run)
    out = read_output(run.path)
    assert [r["adapter"] for r in out] == [r["task"] for r in rows]
    assert [r["text"] for r in out] == [FakeEngine.answer(eng.ids(r["text"]), r["task"]) for r in rows]
    assert max(len(s) for s in eng.loras_in_flight) == 1  # one slot: one adapter in flight at a time
    # two windows (8 rows, then the rest), each adapter by adapter, the second going on with the
    # adapter the first ended with: at most 3 + 3 changes of adapter among the 40 requests sent
    sent = [a for a in eng.sent_adapters if a is not None]
    assert len(eng.sent_adapters) == 40 and changes(sent) <= 6, eng.sent_adapters
    assert changes([r["task"] for r in rows if r["task"]]) == 29  # in input order it would change at almost every row


def test_report_shows_rows_and_tokens_per_adapter(tmp_path: Path, adapters: list[str]) -> None:
    from batchinfer.insight.report import build_report, format_report

    corpus = write_rows(tmp_path / "c.jsonl", ROWS)
    ov = fake_overrides(tmp_path, corpus, "input.id_column=id", "input.adapter_column=task", *adapters)
    run = prepare(compose(ov))
    run_shards(run, [0], engine=keyed(FakeEngine(), run))
    merge(run)
    out = read_output(run.path)
    rep = build_report(run)
    by = {a["adapter"]: a for a in rep["adapters"]}
    # the base model first, the known adapters, then r3's unknown adapter (an error row) under its own name
    assert list(by) == [None, "alpha", "beta", "gamma"]
    assert [a["unknown"] for a in rep["adapters"]] == [False, False, False, True]
    assert out[3]["adapter"] == "gamma" and out[3]["error"]["kind"] == "adapter"
    for name, a in by.items():
        mine = [r for r in out if r["adapter"] == name]
        assert a["rows"] == len(mine) and a["prompt_tokens"] == sum(r["prompt_tokens"] or 0 for r in mine), name
        assert a["output_tokens"] == sum(r["output_tokens"] or 0 for r in mine), name
        assert (a["output_tokens"] > 0) == (name != "gamma"), name
    assert (by[None]["rows"], by[None]["error_rows"], by["alpha"]["rows"], by["alpha"]["error_rows"]) == (1, 0, 2, 0)
    assert (by["gamma"]["rows"], by["gamma"]["error_rows"]) == (1, 1)
    text = format_report(rep, [])
    assert "## Adapters" in text and "| (base model) | 1 | 0 |" in text and "| alpha | 2 | 0 |" in text
    assert "| (unknown: gamma) | 1 | 1 | 0 | 0 |" in text, text


def test_validate_reports_rows_per_adapter(tmp_path: Path, adapters: list[str], tiny_model_path: Path) -> None:
    from batchinfer.insight.validate import validate
    from batchinfer.insight.validate_report import format_report

    corpus = write_rows(tmp_path / "c.jsonl", ROWS)
    base = [f"input.path={corpus}", *model_overrides(tiny_model_path), f"output.dir={tmp_path}/run", *adapters]
    rep = validate(compose([*base, "input.adapter_column=task"]), jobs=1, progress=False)
    assert rep["adapters"] == {"(base model)": 1, "alpha": 2, "beta": 1, "gamma": 1}
    assert rep["error_rows"]["by_kind"]["adapter"]["count"] == 1  # gamma: no such adapter
    assert "adapters     (base model) 1 rows, alpha 2 rows, beta 1 rows, gamma 1 rows" in format_report(rep)
    rep = validate(compose([*base, "input.adapter_column=task", "model.lora.default=beta"]), jobs=1, progress=False)
    assert rep["adapters"] == {"alpha": 2, "beta": 2, "gamma": 1}
    assert validate(compose([*base, "model.lora.default=alpha"]), jobs=1, progress=False)["adapters"] == {"alpha": 5}


def test_plan_adds_the_adapter_slots_to_the_weights(tmp_path: Path, adapters: list[str], tiny_model_path: Path) -> None:
    from batchinfer.insight.plan import estimate
    from batchinfer.insight.plan_text import format_plan

    corpus = write_rows(tmp_path / "c.jsonl", ROWS)
    base = [
        f"input.path={corpus}",
        *model_overrides(tiny_model_path),
        f"output.dir={tmp_path}/run",
        "model.dtype=bfloat16",
    ]
    plain, lora = estimate(compose(base)), estimate(compose([*base, *adapters]))
    # tiny Llama: 2 layers, hidden 128, 2 heads x 64, 1 KV head, MLP 256. Per layer and rank, in
    # features 3x128 + 128 + 2x128 + 256 = 1,024 and out features (128 + 2x64) + 128 + 2x256 + 128
    # = 1,024; two slots (both adapters) of rank 16 (the larger r), 2 bytes each
    assert lora["model"]["lora_bytes"] == 2 * 16 * 2 * (1024 + 1024) * 2 == 262_144
    assert plain["model"]["lora_bytes"] == 0
    assert lora["model"]["weight_bytes"] - plain["model"]["weight_bytes"] == 262_144
    assert lora["gpus"][0]["weight_bytes_per_gpu"] > plain["gpus"][0]["weight_bytes_per_gpu"]
    assert "+ 256.0 KiB of LoRA adapter slots (model.lora: max_loras x max_lora_rank)" in format_plan(lora)


def test_reuse_and_redo_with_adapters(tmp_path: Path, adapters: list[str]) -> None:
    from batchinfer.launch.local import run_local
    from batchinfer.launch.redo import redo

    corpus = write_rows(tmp_path / "c.jsonl", [{"id": f"r{i}", "text": f"text {i}"} for i in range(6)])

    def run(name: str, *extra: str) -> tuple[Any, FakeEngine]:
        ov = [f"input.path={corpus}", f"model.path={fake_model_dir(tmp_path)}", f"output.dir={tmp_path / name}"]
        cfg = compose([*ov, "input.id_column=id", *adapters, *extra])
        eng = FakeEngine()
        eng.key = model_key(to_config(cfg))  # type: ignore[attr-defined]
        return run_local(cfg, engine=eng), eng

    first, _ = run("first", "model.lora.default=alpha")
    again, eng = run("again", "model.lora.default=alpha", f"output.reuse={first.path}")
    assert eng.added == [] and [r["text"] for r in read_output(again.path)] == [
        r["text"] for r in read_output(first.path)
    ]
    other, eng = run("other", "model.lora.default=beta", f"output.reuse={first.path}")
    assert len(eng.added) == 6  # another adapter's answers are not this one's
    assert all(r["adapter"] == "beta" for r in read_output(other.path))
    # redo some rows under another adapter: those rows change, with their adapter column
    eng = FakeEngine()
    eng.key = model_key(first.config)  # type: ignore[attr-defined]
    redo(str(first.path), "row < 2", ["model.lora.default=beta"], engine=eng)
    out = read_output(first.path)
    assert [r["adapter"] for r in out] == ["beta", "beta", "alpha", "alpha", "alpha", "alpha"]
    assert [r["text"] for r in out[:2]] == [FakeEngine.answer(eng.ids(f"text {i}"), "beta") for i in range(2)]


def test_adapter_loads_are_recorded_per_shard_and_shown_in_report_and_status(
    tmp_path: Path, adapters: list[str]
) -> None:
    from batchinfer.insight.report import build_report, format_report
    from batchinfer.insight.status import format_status, shard_status, summarize
    from batchinfer.rundir.progress import read_progress

    rows, ov = interleaved(tmp_path, adapters)
    run = prepare(compose([*ov, "model.lora.max_loras=1", "sharding.num_shards=2", "output.commit_every_rows=4"]))
    eng = keyed(FakeEngine(), run)
    eng.max_loras = 1
    eng.loads = 7  # loads of whatever the engine ran before: not this run's shards'
    counted = []
    for shard in (0, 1):
        before = eng.lora_loads()
        run_shards(run, [shard], engine=eng)  # one engine for both shards, as a task's shards share it
        counted.append(eng.lora_loads() - before)
    assert all(n >= 3 for n in counted), counted  # three adapters in each shard of one slot
    done = [read_progress(run.shard_folder(s).done_path) for s in (0, 1)]
    assert [d.adapter_loads for d in done] == counted
    assert json.loads(run.shard_folder(0).done_path.read_text())["adapter_loads"] == counted[0]
    rep = build_report(run)
    assert [s["adapter_loads"] for s in rep["shards"]] == counted and rep["totals"]["adapter_loads"] == sum(counted)
    text = format_report(rep, [])
    assert f"Adapter loads: {sum(counted)} over 2 shards (at most {max(counted)} in one)" in text, text
    records = shard_status(run, {})
    totals = summarize(records)
    assert [r["adapter_loads"] for r in records] == counted and totals["adapter_loads"] == sum(counted)
    said = format_status(run, records, totals)
    assert f"{sum(counted)} LoRA adapter loads" in said and f"{counted[1]} adapter loads" in said, said


def test_a_run_without_adapters_records_no_adapter_loads(tmp_path: Path) -> None:
    from batchinfer.insight.report import build_report, format_report

    corpus = write_rows(tmp_path / "c.jsonl", ROWS[:3])
    run = prepare(compose(fake_overrides(tmp_path, corpus, "input.id_column=id")))
    run_shards(run, [0], engine=keyed(FakeEngine(), run))
    assert "adapter_loads" not in json.loads(run.shard_folder(0).done_path.read_text())
    rep = build_report(run)
    assert rep["totals"]["adapter_loads"] is None and "Adapter loads" not in format_report(rep, [])


def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty local Hugging Face cache in tmp_path/hub, HF_HUB_CACHE pointed at it (offline)."""
    import huggingface_hub.constants as hc

    hub = tmp_path / "hub"
    hub.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(hub))  # read once at import: the env alone comes too late
    return hub


def cached_adapter(hub: Path, repo: str, r: int, rev: str = "b" * 40) -> Path:
    """A PEFT adapter in the cache's layout (models--ORG--NAME/snapshots/REV, refs/main naming REV)."""
    top = hub / f"models--{repo.replace('/', '--')}"
    snap = top / "snapshots" / rev
    snap.mkdir(parents=True)
    (snap / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": 2 * r}))
    (snap / "adapter_model.safetensors").write_bytes(repo.encode() * 10)
    (top / "refs").mkdir()
    (top / "refs" / "main").write_text(rev)
    return snap


def test_a_hub_id_adapter_is_its_snapshot_in_the_local_cache(
    tmp_path: Path, adapters: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    snap = cached_adapter(hub_cache(tmp_path, monkeypatch), "org/tiny-lora", 8)
    corpus = write_rows(tmp_path / "c.jsonl", ROWS)
    ov = fake_overrides(
        tmp_path,
        corpus,
        "input.id_column=id",
        "input.adapter_column=task",
        *adapters,
        "+model.lora.adapters.hub=org/tiny-lora",
    )
    kw = llm_kwargs(to_config(compose(ov)))
    assert kw["max_lora_rank"] == 16 and kw["max_loras"] == 3  # its r=8 read from the cached adapter_config.json
    run = prepare(compose([*ov, "model.lora.default=hub"]))
    assert run.config.model.lora.adapters["hub"] == str(snap)  # pinned to the snapshot, as model.revision is
    eng = keyed(FakeEngine(), run)
    run_shards(run, [0], engine=eng)
    merge(run)
    out = {r["id"]: r for r in read_output(run.path)}
    assert out["r2"]["adapter"] == "hub" and out["r2"]["text"] == FakeEngine.answer(eng.ids("one"), "hub")
    # the adapter's files are part of the model's identity: a changed snapshot is refused on resume
    (snap / "adapter_model.safetensors").write_bytes(b"retrained")
    with pytest.raises(RunDirError, match=r"LoRA adapter hub .*lora/hub/adapter_model.safetensors changed"):
        check_model_unchanged(run)


def test_a_hub_id_adapter_not_in_the_cache_is_refused_before_dir_is_made(
    tmp_path: Path, adapters: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    hub_cache(tmp_path, monkeypatch)
    corpus = write_rows(tmp_path / "c.jsonl", ROWS)
    ov = fake_overrides(tmp_path, corpus, *adapters, "+model.lora.adapters.hub=org/absent-lora")
    with pytest.raises(ConfigError) as e:
        prepare(compose(ov))
    said = str(e.value)
    assert said.startswith("model.lora.adapters.hub org/absent-lora: not in the local Hugging Face cache"), said
    assert "`huggingface-cli download org/absent-lora`" in said and "\n" not in said
    assert not (tmp_path / "run").exists()
