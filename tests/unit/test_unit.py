"""Fast tests without an engine: config, plan, parts, schema, locks, merge, worker with a fake engine."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pyarrow as pa
import pytest
from support.corpus import read_output, write_corpus
from support.fake_engine import FakeEngine, fake_overrides, keyed, prepared

from batchinfer.config.compose import compose, hydra_literal
from batchinfer.config.fingerprint import changed_keys
from batchinfer.config.schema import ClusterConfig, Config, ModelConfig, PromptConfig, to_config, to_dict
from batchinfer.engine.vllm_engine import Completion
from batchinfer.engine.worker import StopFlag, Stopped
from batchinfer.errors import ConfigError, InputError, RunDirError
from batchinfer.inputs.read import Shard, plan_shards, scan_jsonl
from batchinfer.launch.local import run_shards
from batchinfer.requests.build import overlong_tokens
from batchinfer.requests.prompts import PromptBuilder, RowError
from batchinfer.rundir.locks import ShardLock
from batchinfer.rundir.merge import merge
from batchinfer.rundir.prepare import prepare
from batchinfer.rundir.schema import error_row, output_schema, rows_to_table
from batchinfer.rundir.store import RunDir

# ---------------------------------------------------------------- config


def test_unknown_key_is_named() -> None:
    with pytest.raises(ConfigError, match="prompt.tempalte"):
        compose(["prompt.tempalte=x"])


def test_wrong_type_and_choice_are_named() -> None:
    with pytest.raises(ConfigError) as e:
        compose(["sampling.max_tokens=abc"])
    assert str(e.value) == (
        "sampling.max_tokens: Value 'abc' of type 'str' could not be converted to Integer; "
        "sampling.max_tokens takes an integer >= 1"
    )
    with pytest.raises(ConfigError, match=r"prompt.mode='poem' is not one of: chat, raw"):
        compose(["prompt.mode=poem"])
    with pytest.raises(ConfigError, match="not both"):
        compose(["sharding.num_shards=2", "sharding.rows_per_shard=5"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("sampling.temperature=-1", "sampling.temperature=-1.0 is out of range: it takes a number >= 0 (0 is greedy)"),
        ("sampling.top_p=1.5", "sampling.top_p=1.5 is out of range: it takes a number in (0, 1]"),
        ("sharding.num_shards=0", "sharding.num_shards=0 is out of range: it takes an integer >= 1"),
        (
            "model.gpu_memory_utilization=1.5",
            "model.gpu_memory_utilization=1.5 is out of range: it takes a fraction in (0, 1]",
        ),
        (
            "sampling.min_tokens=300",
            "sampling.min_tokens=300 is out of range: it takes at most sampling.max_tokens=256",
        ),
    ],
)
def test_out_of_range_values_name_key_and_range(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        compose([override])
    assert str(e.value) == message


def test_template_taken_literally_from_the_shell() -> None:
    cfg = compose(["prompt.template=Label: {text} costs ${x} 'q' \\", "prompt.system=Be {brief}"])
    assert cfg.prompt.template == "Label: {text} costs ${x} 'q' \\"
    assert cfg.prompt.system == "Be {brief}"
    assert hydra_literal("a'b") == "'a\\'b'"


def test_typed_config_keeps_literal_text_from_run_yaml() -> None:
    """run.yaml holds resolved plain values: `${` in a template is text when typed again."""
    template = "costs ${x} and \\${y} {text}"
    typed = to_config(to_dict(compose([f"prompt.template={template}", "prompt.labels.names=[a,b]"])))
    assert isinstance(typed, Config) and typed.prompt.template == template
    assert typed.prompt.labels.names == ["a", "b"] and typed.sampling.params["max_tokens"] == typed.sampling.max_tokens
    assert to_config(typed) is typed


def test_resume_overrides_keep_a_template_with_interpolation_text(tmp_path: Path) -> None:
    from batchinfer.launch.submit import apply_resource_overrides

    template = "Price ${{amount}} for {text}"  # `${` is text here, not an OmegaConf interpolation
    run = prepared(tmp_path, 4, f"prompt.template={template}")
    apply_resource_overrides(RunDir(run.path), ["output.commit_every_rows=7"])
    again = RunDir(run.path)
    assert again.config.prompt.template == template and again.config.output.commit_every_rows == 7
    assert again.run["config"]["prompt"]["template"] == template


def test_changed_keys() -> None:
    assert changed_keys({"a": 1, "b": 2}, {"a": 1, "b": 3, "c": 4}) == ["b", "c"]


# ---------------------------------------------------------------- data


def test_plan_shards_by_count_and_size() -> None:
    assert plan_shards(10, 3, None, 100) == [Shard(0, 0, 3), Shard(1, 3, 6), Shard(2, 6, 10)]
    assert plan_shards(10, None, 4, 100) == [Shard(0, 0, 4), Shard(1, 4, 8), Shard(2, 8, 10)]
    assert plan_shards(5, None, None, 100) == [Shard(0, 0, 5)]
    assert plan_shards(2, 5, None, 100) == [Shard(0, 0, 1), Shard(1, 1, 2)]


def test_scan_jsonl_names_the_line(tmp_path: Path) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_bytes(b'{"text": "a"}\n{"text": "b"}\n{"text": oops}\n')
    with pytest.raises(InputError) as e:
        scan_jsonl(p)
    assert str(e.value) == f"{p}:3: not valid JSON (Expecting value at column 10); fix or remove the line"
    p.write_bytes(b'{"text": "a"}\n{"text": "\xff"}\n')
    with pytest.raises(InputError) as e:
        scan_jsonl(p)
    assert str(e.value) == f"{p}:2: invalid UTF-8 at byte 10 of the line, file offset 24; re-encode the file as UTF-8"


def test_missing_and_empty_input(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"input.path .*nope.jsonl: no such file"):
        prepare(compose(fake_overrides(tmp_path, tmp_path / "nope.jsonl")))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(InputError, match=r"empty.jsonl: no rows \(the file is empty\); there is nothing to run"):
        prepare(compose(fake_overrides(tmp_path, tmp_path / "empty.jsonl")))


def test_duplicate_ids_and_unknown_template_field(tmp_path: Path) -> None:
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "a", "text": "x"}\n{"id": "b", "text": "y"}\n{"id": "a", "text": "z"}\n')
    with pytest.raises(InputError, match=r"duplicate id 'a' in rows 0 and 2; ids must be unique"):
        prepare(compose(fake_overrides(tmp_path, corpus, "input.id_column=id")))
    corpus.write_text('{"id": "a", "text": "x"}\n{"text": "y"}\n{"id": null, "text": "z"}\n')
    with pytest.raises(InputError) as e:
        prepare(compose(fake_overrides(tmp_path, corpus, "input.id_column=id")))
    assert str(e.value) == f"{corpus}: row 1: input.id_column 'id' is null or missing; every row needs an id"
    assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match=r"uses \{body\} .* no column 'body' .*\{\{ or \}\}"):
        prepare(compose(fake_overrides(tmp_path, corpus, "prompt.template=Say {body}")))


# ---------------------------------------------------------------- prompts


def test_prompt_builder_chat_raw_and_row_errors() -> None:
    b = PromptBuilder(PromptConfig(template="Label: {text}", system="Be brief", mode="chat"))
    assert b.build({"text": "hi"}) == [
        {"role": "system", "content": "Be brief"},
        {"role": "user", "content": "Label: hi"},
    ]
    raw = PromptBuilder(PromptConfig(template="Q: {text} {{json}}", system=None, mode="raw"))
    assert raw.build({"text": "hi"}) == "Q: hi {json}"
    with pytest.raises(RowError, match="^field 'text' is null or missing$"):
        b.build({"text": None})
    with pytest.raises(RowError, match=r"^the prompt is empty \(field 'text' is blank\)$"):
        PromptBuilder(PromptConfig(template="{text}", system=None, mode="raw")).build({"text": "  "})


def test_template_fields_take_text_numbers_and_bools_not_lists_or_objects() -> None:
    b = PromptBuilder(PromptConfig(template="{text} n={n} ok={ok} {meta.k}", system=None, mode="raw"))
    assert b.build({"text": "t", "n": 2.5, "ok": True, "meta": {"k": 7}}) == "t n=2.5 ok=True 7"
    cases = [
        ({"text": ["a", "b"]}, "field 'text' is a list, not a string, number or bool"),
        ({"meta": {"k": {"x": 1}}}, "field 'meta.k' is an object (dict), not a string, number or bool"),
        ({"meta": {"k": None}}, "field 'meta.k' is null or missing"),
        ({"meta": {"j": 1}}, "field 'meta.k' is missing in this row"),
    ]
    for change, message in cases:
        with pytest.raises(RowError) as e:
            b.build({"text": "t", "n": 1, "ok": False, "meta": {"k": 1}} | change)
        assert e.value.kind == "prompt" and e.value.message.startswith(message), e.value.message
    with pytest.raises(RowError) as e:
        PromptBuilder(PromptConfig(template="Tags: {meta}", system=None, mode="raw")).build({"meta": [1]})
    assert e.value.message == (
        "field 'meta' is a list, not a string, number or bool; "
        "to put JSON in a prompt, write it into a string column first (json.dumps)"
    )


def test_overlong_policies() -> None:
    ids = list(range(10))
    assert overlong_tokens(ids, "error_row", 11, 4) == ids
    with pytest.raises(RowError, match="prompt has 10 tokens; model.max_model_len is 10"):
        overlong_tokens(ids, "error_row", 10, 4)
    assert overlong_tokens(ids, "truncate_left", 8, 2) == ids[-6:]
    assert overlong_tokens(ids, "truncate_right", 8, 6) == ids[:4]
    with pytest.raises(InputError, match="prompt.overlong=fail"):
        overlong_tokens(ids, "fail", 10, 4)


# ---------------------------------------------------------------- schema, parts, locks


def test_schema_keeps_null_optional_columns_concatenable(tmp_path: Path) -> None:
    schema = output_schema(pa.string(), 2, pa.struct([("topic", pa.string())]))
    ok = rows_to_table([{"row": 0, "id": "a", "text": "t", "samples": ["t", "u"], "error": None}], schema)
    bad = rows_to_table([error_row(1, "b", "prompt", "field 'text' is null")], schema)
    both = pa.concat_tables([ok, bad])
    assert both.schema == schema
    assert both.column("samples").to_pylist() == [["t", "u"], None]
    assert both.column("error").to_pylist()[1] == {"kind": "prompt", "message": "field 'text' is null"}


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_part_commit_is_atomic_and_temporaries_are_cleaned(tmp_path: Path, fmt: str) -> None:
    run = prepared(tmp_path, 4, f"output.format={fmt}")
    run.shard_dir(0).mkdir(parents=True)
    table = rows_to_table([error_row(i, f"doc-{i:05d}", "x", "m") for i in (1, 0)], run.schema)
    p0 = run.write_part(0, table)
    p1 = run.write_part(0, rows_to_table([error_row(2, "doc-00002", "x", "m")], run.schema))
    assert [p0.name, p1.name] == [f"part-000000.{fmt}", f"part-000001.{fmt}"]
    (run.shard_dir(0) / f".tmp-part-000002.{fmt}").write_bytes(b"torn")
    assert [p.name for p in run.parts(0)] == [p0.name, p1.name]
    assert run.read_shard(0).column("row").to_pylist() == [1, 0, 2]
    assert run.clean_temporaries(0) == 1
    assert sorted(os.listdir(run.shard_dir(0))) == [p0.name, p1.name]


def test_lock_refuses_second_writer_naming_holder(tmp_path: Path) -> None:
    d = tmp_path / "shard"
    with ShardLock(d):
        with pytest.raises(RunDirError, match=rf"shard is being written by host \S+ pid {os.getpid()}"):
            with ShardLock(d):
                pass
    with ShardLock(d):  # released: free again
        pass


# ---------------------------------------------------------------- worker (fake engine) and merge


def test_fake_engine_run_commits_often_dedupes_and_merges_in_order(tmp_path: Path) -> None:
    corpus = tmp_path / "c.jsonl"
    rows = write_corpus(corpus, 30)
    rows[5]["text"] = rows[7]["text"] = rows[9]["text"] = "same prompt"
    rows[11]["text"] = None
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = prepare(
        compose(
            fake_overrides(
                tmp_path, corpus, "input.id_column=id", "sharding.num_shards=2", "output.commit_every_rows=4"
            )
        )
    )
    eng = FakeEngine()
    run_shards(run, [0, 1], engine=keyed(eng, run))
    assert sum(1 for ids in eng.added if ids == eng.encode([{"content": "same prompt"}])) == 1
    stats = merge(run)
    out = read_output(run.path)
    assert [r["row"] for r in out] == list(range(30))
    assert [r["id"] for r in out] == [r["id"] for r in rows]
    assert out[7]["text"] == out[9]["text"] == "len11"
    assert out[11]["error"] == {"kind": "prompt", "message": "row 11: field 'text' is null or missing"}
    assert stats["rows"] == 30 and stats["errors"] == {"prompt": 1}
    done = json.loads(run.done_path(0).read_text())
    assert done["parts"] >= 3  # committed between steps, not once at the end (then compacted)
    assert done["device"] == "fake device" and done["model"]["path"] == run.run["config"]["model"]["path"]


def test_stop_flag_commits_then_resume_finishes(tmp_path: Path) -> None:
    from batchinfer.engine.worker import ShardWorker, Stopped

    run = prepared(tmp_path, 20, "output.commit_every_rows=100")
    stop = StopFlag()
    eng = FakeEngine(per_step=3)
    real_step = eng.step

    def step_then_signal() -> list[Completion]:
        stop.signum = 15
        return real_step()

    eng.step = step_then_signal  # type: ignore[method-assign]
    with pytest.raises(Stopped):
        ShardWorker(run, lambda: eng, stop).run_shard(Shard(0, 0, 20))
    assert run.read_shard(0).num_rows == 3 and not run.is_done(0)
    second = FakeEngine()
    run_shards(run, [0], engine=keyed(second, run))
    assert len(second.added) == 17  # only what was missing
    assert [r["row"] for r in read_output(merge(run) and run.path)] == list(range(20))


def test_merge_refuses_naming_incomplete_shards(tmp_path: Path) -> None:
    run = prepared(tmp_path, 9, "sharding.num_shards=3")
    with pytest.raises(RunDirError, match=r"3 of 3 shards are incomplete \(shards 0, 1, 2\)"):
        merge(run)


def test_fingerprint_refusal_names_changed_keys(tmp_path: Path) -> None:
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 5)
    prepare(compose(fake_overrides(tmp_path, corpus)))
    with pytest.raises(RunDirError, match=r"sampling.max_tokens \(256 -> 7\)"):
        prepare(compose(fake_overrides(tmp_path, corpus, "sampling.max_tokens=7")))
    prepare(compose(fake_overrides(tmp_path, corpus, "output.commit_every_rows=3")))  # outside the fingerprint
    write_corpus(corpus, 6)
    with pytest.raises(RunDirError, match=r"input.fingerprint"):
        prepare(compose(fake_overrides(tmp_path, corpus)))


# ---------------------------------------------------------------- Slurm planning (no cluster)


def test_arrays_split_at_max_array_size_and_gpus_checked(tmp_path: Path, monkeypatch, capsys) -> None:
    from batchinfer.launch import slurm
    from batchinfer.launch.submit import submit_shards

    assert slurm.split_tasks([[0], [1], [2], [3], [4]], 2) == [[[0], [1]], [[2], [3]], [[4]]]
    run = prepared(tmp_path, 10, "cluster=slurm", "sharding.num_shards=5", "cluster.shards_per_task=1")
    monkeypatch.setattr(slurm, "max_array_size", lambda: 2)
    record = submit_shards(run, [0, 1, 2, 3, 4], dry_run=True)
    assert [a["tasks"] for a in record["arrays"]] == [{0: [0], 1: [1]}, {0: [2], 1: [3]}, {0: [4]}]
    out = capsys.readouterr().out
    assert "array 2: 1 tasks" in out and "'signal_delay_s': 120" in out and "'requeue': True" in out
    with pytest.raises(ConfigError, match=r"cluster.gpus_per_task=1 is less than .* = 2"):
        slurm.check_gpus(Config(model=ModelConfig(tensor_parallel_size=2), cluster=ClusterConfig(gpus_per_task=1)))


def test_env_lines_quote_values() -> None:
    from batchinfer.launch.slurm import env_lines

    assert env_lines({"A": "x y $(rm -rf /)", "B": None}) == ["export A='x y $(rm -rf /)'", "unset B"]
    with pytest.raises(ConfigError, match="not a valid environment variable name"):
        env_lines({"A;B": "1"})


# ---------------------------------------------------------------- presets and models


MODEL_PRESETS = [
    "smollm2-135m",
    "llama-3.1-8b-instruct",
    "llama-3.1-8b-instruct-fp8",
    "llama-3.3-70b-instruct-fp8",
    "qwen3-8b",
    "all-minilm-l6-v2",
]
QUANT_PRESETS = {
    "none": (None, "auto"),
    "fp8": ("fp8", "auto"),
    "awq": ("awq", "auto"),
    "gptq": ("gptq", "auto"),
    "kv-fp8": (None, "fp8"),
}


@pytest.mark.parametrize("model", MODEL_PRESETS)
def test_every_model_and_quantization_preset_composes(model: str) -> None:
    for quant, (method, kv) in QUANT_PRESETS.items():
        cfg = compose([f"model={model}", f"quantization={quant}", "cluster=slurm"])
        assert cfg.model.path and cfg.model.max_model_len
        assert (cfg.quantization.method, cfg.quantization.kv_cache_dtype) == (method, kv)
    assert compose(["model=llama-3.3-70b-instruct-fp8"]).model.tensor_parallel_size == 2
    assert compose([]).model.path.endswith("/models/SmolLM2-135M-Instruct")


def test_hub_name_pinned_to_cached_revision(tmp_path: Path, monkeypatch) -> None:
    from batchinfer.models.locations import resolve_model

    snap = tmp_path / "hub" / "models--org--tiny" / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_model("org/tiny", None) == ("org/tiny", "a" * 40)
    with pytest.raises(
        ConfigError, match=r"org/missing: not in the local Hugging Face cache.*huggingface-cli download org/missing"
    ):
        resolve_model("org/missing", None)


def test_work_order_groups_shared_prefixes_then_sorts_by_length() -> None:
    from batchinfer.engine.worker import PREFIX_TOKENS, work_order

    a, b = tuple(range(PREFIX_TOKENS)), tuple(range(100, 100 + PREFIX_TOKENS))
    keys = [(b + (1, 2, 3), "", -1), (a + (9,) * 10, "", -1), (b + (5,), "", -1), (a + (7,), "", -1)]
    ordered = sorted(keys, key=work_order)
    assert [len(k[0]) - PREFIX_TOKENS for k in ordered] == [1, 10, 1, 3]
    assert [k[0][:PREFIX_TOKENS] for k in ordered] == [a, a, b, b]


def test_trace_records_rows_finished_per_step(tmp_path: Path, monkeypatch) -> None:
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 20)
    run = prepare(compose(fake_overrides(tmp_path, corpus, "output.commit_every_rows=4")))
    trace = tmp_path / "trace.txt"
    monkeypatch.setenv("BATCHINFER_TRACE", str(trace))
    run_shards(run, [0], engine=keyed(FakeEngine(), run))
    counts = [int(line.split()[1]) for line in trace.read_text().splitlines()]
    assert counts == sorted(counts) and counts[-1] == 20  # what redo_bench compares with committed rows


def test_hold_waits_after_the_first_commit_until_a_stop_signal(tmp_path: Path, monkeypatch) -> None:
    """BATCHINFER_HOLD: the Slurm tests' way to signal a shard that is surely partial."""
    from batchinfer import faults

    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 20)
    run = prepare(compose(fake_overrides(tmp_path, corpus, "output.commit_every_rows=4")))
    monkeypatch.setenv("BATCHINFER_HOLD", "60")
    monkeypatch.setattr(faults, "_held", False)
    seen: list[int] = []

    def stop_during_hold() -> None:  # the hold's sleep is where the signal lands
        time.sleep(0.5)
        seen.append(RunDir(run.path).read_shard(0).num_rows)
        if not run.is_done(0):  # a finished run has no handler left: USR2 would end pytest
            os.kill(os.getpid(), signal.SIGUSR2)

    threading.Thread(target=stop_during_hold).start()
    t0 = time.monotonic()
    with pytest.raises(Stopped):
        run_shards(run, [0], engine=keyed(FakeEngine(), run))
    assert time.monotonic() - t0 < 30 and seen and 0 < seen[0] < 20  # held on a partial shard, not 60 s
    assert 0 < run.read_shard(0).num_rows < 20 and not run.is_done(0)
    # once per process, and never in a requeued Slurm job's later runs
    faults.hold(lambda: False)
    monkeypatch.setattr(faults, "_held", False)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    t0 = time.monotonic()
    faults.hold(lambda: False)
    assert time.monotonic() - t0 < 1


@pytest.mark.parametrize(
    "error",
    [
        OSError(28, "No space left on device"),
        OSError("[Errno 28] Error writing bytes to file: No space left on device"),
    ],
)
def test_merge_on_a_full_disk_leaves_no_partial_output(tmp_path: Path, monkeypatch, error: OSError) -> None:
    """pyarrow puts the errno only in its message: both forms are a StorageError naming the output."""
    from batchinfer.errors import StorageError
    from batchinfer.rundir import merge as merge_module

    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 12)
    run = prepare(compose(fake_overrides(tmp_path, corpus, "sharding.num_shards=2")))
    run_shards(run, [0, 1], engine=keyed(FakeEngine(), run))
    calls = {"n": 0}
    real = merge_module.OutputWriter.write

    def write(self, table):  # the second shard's rows hit a full disk
        calls["n"] += 1
        if calls["n"] == 2:
            raise error
        real(self, table)

    monkeypatch.setattr(merge_module.OutputWriter, "write", write)
    with pytest.raises(StorageError, match=rf"cannot write {run.output_path}: the disk is full"):
        merge(run)
    assert not run.output_path.exists() and not list(run.path.glob(".tmp-*"))
    monkeypatch.setattr(merge_module.OutputWriter, "write", real)
    assert merge(run)["rows"] == 12 and len(read_output(run.path)) == 12


def test_task_presets_compose_and_task_keys_belong_to_their_task() -> None:
    embed = compose(["task=embed"])
    assert (embed.task.name, embed.prompt.mode, embed.prompt.overlong) == ("embed", "raw", "truncate_right")
    assert compose(["task=classify", "prompt.overlong=error_row"]).prompt.overlong == "error_row"  # the user's wins
    plain = compose([])
    assert (plain.task.name, plain.prompt.mode, plain.prompt.overlong) == ("generate", "chat", "error_row")
    score = compose(["task=score", "task.query=Q: {q}", "task.document={d} ${x}"])
    assert (score.task.query, score.task.document) == ("Q: {q}", "{d} ${x}")  # taken literally, like templates
    with pytest.raises(ConfigError, match=r"task=score needs two texts per row: task.query and task.document"):
        compose(["task=score", "task.query={q}"])
    with pytest.raises(ConfigError, match=r"task.min_prob is a setting of task=classify; this run has task=embed"):
        compose(["task=embed", "task.min_prob=0.5"])
    with pytest.raises(ConfigError, match=r"task.name='rank' is not one of: generate, embed, classify, score"):
        compose(["task.name=rank"])
