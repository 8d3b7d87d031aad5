"""The composed config: errors that name the key, literal templates, presets, changed keys."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.corpus import write_corpus
from support.fake_engine import fake_overrides, prepared

from batchinfer.config.compose import compose, hydra_literal
from batchinfer.config.fingerprint import changed_keys
from batchinfer.config.schema import Config, to_config, to_dict
from batchinfer.errors import ConfigError, RunDirError
from batchinfer.rundir.prepare import prepare
from batchinfer.rundir.store import RunDir


def test_unknown_key_is_named() -> None:
    with pytest.raises(ConfigError, match="prompt.tempalte"):
        compose(["prompt.tempalte=x"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("cluster.env={A: b}", "cluster.env has no key A yet: write +cluster.env.A=... to add it"),
        ("cluster={env: {A: b}}", "cluster.env has no key A yet: write +cluster.env.A=... to add it"),
        ("cluster.sbatch_extra={a: b}", "cluster.sbatch_extra has no key a yet: write +cluster.sbatch_extra.a="),
        ("cluster={partitionn: x}", "cluster.partitionn is not a key (did you mean cluster.partition?)"),
    ],
)
def test_a_dict_assigned_to_a_key_names_the_key_inside_it(override: str, message: str) -> None:
    """Not "cluster.env is not a key (did you mean cluster.env?)": the key missing is the dict's."""
    with pytest.raises(ConfigError) as e:
        compose([override])
    assert str(e.value).startswith(message), str(e.value)


def test_wrong_type_and_choice_are_named() -> None:
    with pytest.raises(ConfigError) as e:
        compose(["sampling.max_tokens=abc"])
    assert str(e.value) == (
        "sampling.max_tokens: Value 'abc' of type 'str' could not be converted to Integer; "
        "sampling.max_tokens takes an integer in [1, 2^64)"
    )
    with pytest.raises(ConfigError, match=r"prompt.mode='poem' is not one of: chat, raw"):
        compose(["prompt.mode=poem"])
    with pytest.raises(ConfigError, match="not both"):
        compose(["sharding.num_shards=2", "sharding.rows_per_shard=5"])


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "sampling.temperature=-1",
            "sampling.temperature=-1.0 is out of range: it takes a finite number in [0, 2] (0 is greedy)",
        ),
        ("sampling.top_p=1.5", "sampling.top_p=1.5 is out of range: it takes a number in (0, 1]"),
        ("sharding.num_shards=0", "sharding.num_shards=0 is out of range: it takes an integer >= 1"),
        (
            "model.gpu_memory_utilization=1.5",
            "model.gpu_memory_utilization=1.5 is out of range: it takes a fraction in (0, 1]",
        ),
        (
            "sampling.min_tokens=300",
            "sampling.min_tokens=300 is out of range: it takes at most max_tokens=256",
        ),
        (  # vLLM's msgpack encoder refuses it at add_request (OverflowError); 10**12 it runs to the context
            "sampling.max_tokens=18446744073709551616",
            "sampling.max_tokens=18446744073709551616 is out of range: it takes an integer in [1, 2^64)",
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


def test_task_presets_compose_and_task_keys_belong_to_their_task() -> None:
    embed = compose(["task=embed"])
    assert (embed.task.name, embed.prompt.mode, embed.prompt.overlong) == ("embed", "raw", "truncate_right")
    # the user's wins (a classifier named: the default model has no classes, which compose refuses)
    classify = compose(["task=classify", "model.path=org/a-classifier", "prompt.overlong=error_row"])
    assert classify.prompt.overlong == "error_row"
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


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["prompt.mode=raw", "prompt.system=Be brief"], "prompt.mode=raw .* prompt.system would be dropped"),
        (["prompt.mode=raw", "+prompt.examples=[{text: a, answer: b}]"], "prompt.examples would be dropped"),
        (["prompt=labels", "prompt.mode=raw", "prompt.labels.names=[a,b]"], "prompt.labels would be dropped"),
        (["task=embed", "prompt.labels.names=[a,b]"], "task=embed .* prompt.labels would be ignored"),
        (
            ["task=embed", "sampling.structured_outputs.regex='[a-z]+'"],
            "sampling.structured_outputs.regex would be ignored",
        ),
        (["task=classify", "sampling.n=3"], "task=classify .* sampling.n=3 would be ignored"),
    ],
)
def test_settings_a_run_would_drop_are_refused(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        compose(overrides)


def test_raw_mode_and_pooling_tasks_compose_without_those_settings() -> None:
    assert compose(["prompt.mode=raw"]).prompt.mode == "raw"
    assert compose(["task=embed"]).prompt.mode == "raw"  # the embed preset: raw text


@pytest.mark.parametrize(
    ("override", "key", "value"),
    [
        ("sampling.stop=###", "sampling.stop", ["###"]),
        ("sampling.stop=\n\n", "sampling.stop", ["\n\n"]),
        ("sampling.stop=[END,'###']", "sampling.stop", ["END", "###"]),  # Hydra's list syntax still works
        ("sampling.stop='###'", "sampling.stop", ["###"]),  # in Hydra's quotes, as it had to be written
        (
            'sampling.structured_outputs.json={"type": "object"}',
            "sampling.structured_outputs.json",
            '{"type": "object"}',
        ),
        ("sampling.structured_outputs.regex=[a-z]+", "sampling.structured_outputs.regex", "[a-z]+"),
        ("sampling.structured_outputs.regex='[0-9]{3}'", "sampling.structured_outputs.regex", "[0-9]{3}"),  # quoted
        (
            "sampling.structured_outputs.grammar=root ::= [a-z]+",
            "sampling.structured_outputs.grammar",
            "root ::= [a-z]+",
        ),
        ("prompt.labels.description=Pick {one}: a, b ${x}", "prompt.labels.description", "Pick {one}: a, b ${x}"),
        ("sampling.structured_outputs.regex=null", "sampling.structured_outputs.regex", None),  # null unsets
        ("sampling.structured_outputs.regex='null'", "sampling.structured_outputs.regex", "null"),
    ],
)
def test_values_hydra_cannot_lex_are_taken_literally(override: str, key: str, value: object) -> None:
    """`###`, `{...}`, `[a-z]+`, a `{` in a description: the value as typed, not a Hydra lexer error."""
    from omegaconf import OmegaConf

    cfg = compose([override])
    got = OmegaConf.select(cfg, key)
    assert (list(got) if key == "sampling.stop" else got) == value


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["model.dtype=bf16"],
            "model.dtype='bf16' is not a name vLLM knows (did you mean bfloat16?); it takes one of: auto, half, "
            "float16, bfloat16, float, float32",
        ),
        (["quantization.method=fp9"], "quantization.method='fp9' is not a name vLLM knows (did you mean fp8?); "),
        (["quantization.kv_cache_dtype=fp8_e4m2"], "quantization.kv_cache_dtype='fp8_e4m2' is not a name vLLM knows"),
        (
            ["model.reasoning_parser=qwen"],
            "model.reasoning_parser='qwen' is not a name vLLM knows (did you mean qwen3?)",
        ),
        (
            ["sampling.logprobs=21"],
            "sampling.logprobs=21 asks for 21 log probabilities per token, above vLLM's limit of 20 (max_logprobs): "
            "ask for fewer, or raise the limit with model.engine_kwargs.max_logprobs=21",
        ),
        (["sampling.logprobs=-1"], "sampling.logprobs=-1 asks for the whole vocabulary, above vLLM's limit of 20"),
        (
            ["sampling.logprobs=60", "+model.engine_kwargs.max_logprobs=50"],
            "sampling.logprobs=60 asks for 60 log probabilities per token, above vLLM's limit of 50",
        ),
        (
            ["task=classify", "output.format=openai"],
            "output.format=openai writes OpenAI Batch responses, which task=classify rows are not; choose "
            "output.format=parquet, jsonl or hf",
        ),
        (
            ["task=score", "task.query={q}", "task.document={d}", "output.format=openai"],
            "output.format=openai writes OpenAI Batch responses, which task=score rows are not;",
        ),
        (
            ["task=embed", "output.format=openai"],
            "output.format=openai writes OpenAI Batch responses, which task=embed rows are not (task=embed writes "
            "them for OpenAI Batch /v1/embeddings requests: set input.format=openai)",
        ),
    ],
)
def test_settings_vllm_or_merge_would_refuse_are_refused_at_compose(overrides: list[str], message: str) -> None:
    """Refused by compose, which run, submit, plan and validate all start with (before DIR exists)."""
    with pytest.raises(ConfigError) as e:
        compose(overrides)
    assert str(e.value).startswith(message)


def test_known_vllm_names_and_limits_compose() -> None:
    for ov in (
        ["model.dtype=float16", "quantization.method=awq_marlin", "quantization.kv_cache_dtype=fp8_e5m2"],
        ["model.reasoning_parser=deepseek_r1", "sampling.logprobs=20"],
        ["sampling.logprobs=-1", "+model.engine_kwargs.max_logprobs=-1"],
        ["model.reasoning_parser=mine", "+model.engine_kwargs.reasoning_parser_plugin=/opt/my_parser.py"],
        ["task=embed", "output.format=openai", "input.format=openai"],  # /v1/embeddings lines answered in kind
    ):
        compose(ov)


def test_structured_outputs_schema_is_read_and_checked_at_compose(tmp_path: Path) -> None:
    """A missing, non-JSON or non-schema sampling.structured_outputs.json stops compose (so validate,
    run and submit), naming the key, the file and what is wrong."""
    key = "sampling.structured_outputs.json"
    cases = {
        f"{key}={tmp_path}/nope.json": f"{key} {tmp_path}/nope.json: cannot read it (No such file or directory",
        f'{key}={{"type": "object"': f"{key} (inline): not valid JSON (Expecting ',' delimiter",
        f"{key}=[1, 2]": f"{key} [1, 2]: cannot read it",  # not inline JSON: a path, which is not there
        f'{key}={{"type": "obj"}}': f"{key} (inline): not a JSON schema: it has type 'obj', not one of: array, ",
    }
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "nested.json").write_text('{"type": "object", "properties": {"a": {"type": "str"}}}')
    (tmp_path / "text.json").write_text("not json")
    cases[f"{key}={tmp_path}/list.json"] = (
        f"{key} {tmp_path}/list.json: not a JSON schema: it is a list, but a schema is an object"
    )
    cases[f"{key}={tmp_path}/nested.json"] = f"{key} {tmp_path}/nested.json: not a JSON schema: properties.a has type"
    cases[f"{key}={tmp_path}/text.json"] = f"{key} {tmp_path}/text.json: not valid JSON (Expecting value"
    for override, message in cases.items():
        with pytest.raises(ConfigError) as e:
            compose([override])
        assert str(e.value).startswith(message), (override, str(e.value))
    (tmp_path / "ok.json").write_text('{"type": "object", "properties": {"a": {"enum": [{"type": "x"}]}}}')
    assert compose([f"{key}={tmp_path}/ok.json"]).sampling.structured_outputs.json == f"{tmp_path}/ok.json"


def test_an_unset_environment_reference_is_named_with_its_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BI_UNSET_ACCOUNT", raising=False)
    with pytest.raises(ConfigError) as e:
        compose(["cluster.account=${oc.env:BI_UNSET_ACCOUNT}"])
    assert str(e.value) == (
        "cluster.account refers to ${oc.env:BI_UNSET_ACCOUNT}, which is not set in this shell: "
        "`export BI_UNSET_ACCOUNT=...` first, or give cluster.account a plain value"
    )


def test_an_image_window_past_a_tebibyte_is_refused_in_one_line() -> None:
    compose(["cluster.image_window_mb=1048576"])
    with pytest.raises(ConfigError, match=r"cluster.image_window_mb.*from 1 to 1048576 \(1 TiB\)"):
        compose(["cluster.image_window_mb=99999999999999999999"])
