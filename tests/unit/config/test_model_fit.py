"""Settings the model folder cannot take (config.json only, no weights): refused by compose, so by
`run`, `submit` and `validate` alike, before a run directory exists."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.corpus import write_corpus
from support.model_configs import LLAMA_8B

from batchinfer.cli import build_parser, cmd_run, cmd_submit, cmd_validate
from batchinfer.config.compose import compose
from batchinfer.errors import ConfigError

BERT = {"architectures": ["BertModel"], "model_type": "bert", "hidden_size": 384, "max_position_embeddings": 512}


def model(folder: Path, config: dict, **files: dict) -> Path:
    """A model folder of config.json (and other JSON files by name) only."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    for name, content in files.items():
        (folder / name.replace("__", ".")).write_text(json.dumps(content))
    return folder


def refused(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as e:
        compose(overrides)
    return str(e.value)


# The default preset's max_model_len (SmolLM2's 2048) is more than BERT's 512 positions allow.
FITS = "model.max_model_len=512"


def test_max_model_len_above_what_the_model_allows_is_refused(tmp_path: Path) -> None:
    llama = model(tmp_path / "llama", LLAMA_8B)  # max_position_embeddings 131072
    assert refused([f"model.path={llama}", "model.max_model_len=200000"]) == (
        f"model.max_model_len=200,000 is above what model.path {llama} allows: 131,072 (config.json "
        "max_position_embeddings), and vLLM would refuse to start; set model.max_model_len=131072 or less "
        "(or unset it), or, if the model is known to handle more, cluster.env.VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"
    )
    assert compose([f"model.path={llama}", "model.max_model_len=131072"]).model.max_model_len == 131072
    # vLLM's own escape hatch, where the engine will see it
    compose([f"model.path={llama}", "model.max_model_len=200000", "+cluster.env.VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"])
    # RoPE scaling raises the limit, as vLLM derives it
    rope = model(
        tmp_path / "rope", dict(LLAMA_8B, max_position_embeddings=4096, rope_scaling={"type": "linear", "factor": 4.0})
    )
    compose([f"model.path={rope}", "model.max_model_len=16384"])
    assert "allows: 16,384 (config.json max_position_embeddings x RoPE factor 4)" in refused(
        [f"model.path={rope}", "model.max_model_len=16385"]
    )
    # no length in config.json: vLLM takes whatever is set
    compose([f"model.path={model(tmp_path / 'bare', {})}", "model.max_model_len=1000000"])


def test_a_pooling_model_window_follows_its_sentence_transformers_config(tmp_path: Path) -> None:
    """all-MiniLM-L6-v2's shape: 512 positions, but sentence_bert_config.json's max_seq_length 256 wins."""
    minilm = model(tmp_path / "minilm", BERT, sentence_bert_config__json={"max_seq_length": 256})
    compose([f"model.path={minilm}", "task=embed", "model.max_model_len=256"])
    assert "allows: 256 (sentence_bert_config.json max_seq_length)" in refused(
        [f"model.path={minilm}", "task=embed", "model.max_model_len=512"]
    )


def test_classify_needs_a_model_with_classes(tmp_path: Path) -> None:
    plain = model(tmp_path / "plain", BERT)
    assert refused([f"model.path={plain}", FITS, "task=classify"]) == (
        f"model.path {plain}: config.json names no classes (id2label, num_labels): task=classify needs a "
        "sequence-classification model"
    )
    labelled = model(tmp_path / "clf", dict(BERT, id2label={"0": "neg", "1": "pos"}))
    assert compose([f"model.path={labelled}", FITS, "task=classify"]).task.name == "classify"


def test_dimensions_must_be_ones_the_model_gives(tmp_path: Path) -> None:
    plain = model(tmp_path / "plain", BERT)
    assert refused([f"model.path={plain}", FITS, "task=embed", "task.dimensions=128"]).startswith(
        f"task.dimensions=128: model.path {plain} does not have Matryoshka embeddings (config.json has no "
        "matryoshka_dimensions or is_matryoshka), so vLLM refuses to shorten them; unset task.dimensions"
    )
    mrl = model(tmp_path / "mrl", dict(BERT, matryoshka_dimensions=[64, 128, 384]))
    assert compose([f"model.path={mrl}", FITS, "task=embed", "task.dimensions=128"]).task.dimensions == 128
    assert refused([f"model.path={mrl}", FITS, "task=embed", "task.dimensions=100"]) == (
        f"task.dimensions=100: model.path {mrl} gives only the Matryoshka dimensions [64, 128, 384] "
        "(config.json matryoshka_dimensions), so vLLM refuses 100; choose one of them"
    )
    assert refused([f"model.path={mrl}", FITS, "task=embed", "task.dimensions=1024"]) == (
        f"task.dimensions=1024 is above the model's embedding size 384 (model.path {mrl}); set "
        "task.dimensions=384 or less, or unset it"
    )


def test_a_model_that_is_not_there_is_left_to_prepare_to_name(tmp_path: Path) -> None:
    """compose does not report a missing model: prepare and validate name it, with how to get it."""
    assert compose([f"model.path={tmp_path / 'nope'}", "model.max_model_len=10"]).model.max_model_len == 10
    assert compose(["model.path=org/not-cached", "task=classify"]).task.name == "classify"


@pytest.mark.parametrize("command", [cmd_run, cmd_submit, cmd_validate])
def test_run_submit_and_validate_refuse_before_the_run_directory_exists(tmp_path: Path, command: object) -> None:
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 3)
    plain = model(tmp_path / "plain", BERT)
    name = command.__name__.removeprefix("cmd_")  # type: ignore[attr-defined]
    args = build_parser().parse_args(
        [name, f"input.path={corpus}", f"model.path={plain}", FITS, "task=classify", f"output.dir={tmp_path / 'run'}"]
    )
    with pytest.raises(ConfigError, match="config.json names no classes"):
        command(args)  # type: ignore[operator]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command", [cmd_run, cmd_submit, cmd_validate])
def test_an_openai_batch_file_with_a_task_it_has_no_answer_for_is_refused_before_the_run_directory(
    tmp_path: Path, command: object
) -> None:
    """A file recognised as OpenAI Batch (input.format unset) answers in the OpenAI format, which
    classify rows have none of: before, every row was computed and merge failed with a KeyError."""
    from support.openai_batch import request

    corpus = tmp_path / "batch.jsonl"
    corpus.write_text(request("a", {"model": "x", "messages": [{"role": "user", "content": "hi"}]}))
    classifier = model(
        tmp_path / "cls", dict(BERT, architectures=["BertForSequenceClassification"], id2label={"0": "no", "1": "yes"})
    )
    name = command.__name__.removeprefix("cmd_")  # type: ignore[attr-defined]
    args = build_parser().parse_args(
        [
            name,
            f"input.path={corpus}",
            f"model.path={classifier}",
            FITS,
            "task=classify",
            f"output.dir={tmp_path / 'run'}",
        ]
    )
    with pytest.raises(
        ConfigError, match=r"batch.jsonl is an OpenAI Batch file, .* task=classify rows have no form for"
    ):
        command(args)  # type: ignore[operator]
    assert not (tmp_path / "run").exists()


def test_an_openai_chat_line_in_a_pooling_run_is_an_error_row() -> None:
    """task_mismatch: chat and completion lines run with task=generate only (classify, score and embed refuse them)."""
    from batchinfer.inputs.openai_batch import task_mismatch

    chat = {"url": "/v1/chat/completions"}
    assert task_mismatch(chat, "generate") is None
    for task in ("classify", "score", "embed"):
        assert task_mismatch(chat, task) == (
            f"a /v1/chat/completions request runs with task=generate, and this run has task={task}: "
            "submit those lines as their own run"
        )
    assert task_mismatch({"url": "/v1/embeddings", "_raw_prompt": "x"}, "generate").startswith(
        "a /v1/embeddings request runs with task=embed"
    )
