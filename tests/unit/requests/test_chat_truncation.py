"""prompt.overlong=truncate_* in chat mode cuts the row's own text and renders the chat again: the
system prompt, examples, labels and the generation header stay whole; a chat whose fixed turns
leave no room for the row's text is an overlong error row (issue 26)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jinja2
import pytest
from support.corpus import read_output
from support.fake_engine import FakeEngine, fake_overrides, keyed

from batchinfer.config.compose import compose
from batchinfer.config.schema import Config, to_config, to_dict
from batchinfer.inputs.convert import open_input
from batchinfer.insight.row_check import check_rows
from batchinfer.launch.local import run_shards
from batchinfer.requests.build import build_request
from batchinfer.requests.prompts import PromptBuilder, RowError, apply_labels
from batchinfer.rundir.merge import merge
from batchinfer.rundir.prepare import prepare

# A chat template with a generation header, as real models have (the tiny test model has none).
TEMPLATE = jinja2.Template(
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>", autoescape=False
)
HEADER = "<|assistant|>"
TOKEN = re.compile(r"<\|\w+\|>|\w+|\s|[^\w\s]")  # role markers, words, single other characters


class WordTokenizer:
    """One token per word, space or mark (so a cut by characters is not exact in tokens)."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}
        self.words: list[str] = []

    def encode(self, prompt: Any, chat_template_kwargs: Any = None) -> list[int]:
        text = prompt if isinstance(prompt, str) else TEMPLATE.render(messages=prompt)
        ids = []
        for t in TOKEN.findall(text):
            if t not in self.vocab:
                self.vocab[t] = len(self.words)
                self.words.append(t)
            ids.append(self.vocab[t])
        return ids

    def decode(self, ids: list[int]) -> str:
        return "".join(self.words[i] for i in ids)


TEXT = " ".join(f"w{i}" for i in range(120))  # 239 tokens
LABELS = ["prompt.labels.names=[physics,biology]", "prompt.labels.description=Pick the field."]
EXAMPLE = "prompt.examples=[{text: an example, answer: physics}]"


def labelled(*extra: str) -> Config:
    """A config with labels (a system prompt naming them, as prepare makes it) and one example."""
    c = to_dict(compose([*LABELS, EXAMPLE, "sampling.max_tokens=10", *extra]))
    apply_labels(c)
    return to_config(c)


def fitted(policy: str, max_model_len: int, text: str = TEXT) -> tuple[str, list[int]]:
    """The text and ids a row's chat is sent as, under this policy and window."""
    cfg = labelled(f"prompt.overlong={policy}")
    tok = WordTokenizer()
    req = build_request(cfg, PromptBuilder(cfg.prompt), {"text": text}, 0, tok.encode)
    ids = req.fit(policy, max_model_len)
    return tok.decode(ids), ids


def fixed_head() -> str:
    """The rendered chat before the row's text: system prompt with the labels, the example."""
    cfg = labelled()
    head = TEMPLATE.render(messages=PromptBuilder(cfg.prompt).build({"text": "\x00"}))
    return head[: head.index("\x00")]


@pytest.mark.parametrize("policy", ["truncate_right", "truncate_left"])
def test_a_chat_keeps_its_system_prompt_labels_examples_and_header(policy: str) -> None:
    text, ids = fitted(policy, 100)
    head = fixed_head()
    assert "Pick the field.\nAnswer with exactly one of these labels and nothing else: physics, biology" in head
    assert "<|user|>an example\n<|assistant|>physics\n<|user|>" in head
    assert text.startswith(head) and text.endswith("\n" + HEADER)  # whole, around the row's text
    kept = text[len(head) : -len("\n" + HEADER)]
    assert kept and len(kept) < len(TEXT)
    assert TEXT.startswith(kept) if policy == "truncate_right" else TEXT.endswith(kept)
    # as long as the window allows, leaving room for max_tokens (10): within a word of the limit
    assert 100 - 10 - 2 <= len(ids) <= 100 - 10


def test_rows_that_fit_are_not_touched() -> None:
    text, ids = fitted("truncate_right", 1000)
    assert text == fixed_head() + TEXT + "\n" + HEADER


def test_a_chat_whose_fixed_turns_fill_the_window_is_an_overlong_error_row() -> None:
    head_tokens = len(WordTokenizer().encode(fixed_head() + "\n" + HEADER))
    for policy in ("truncate_right", "truncate_left"):
        with pytest.raises(RowError) as e:
            fitted(policy, head_tokens)  # the row's text cut to nothing still leaves no room
        assert e.value.kind == "overlong"
        assert f"without its last user text the chat alone takes {head_tokens} tokens" in e.value.message
    text, _ = fitted("truncate_right", head_tokens + 2)  # room for one token of the row's text
    assert text == fixed_head() + "w0\n" + HEADER


def test_a_rows_own_messages_cut_their_last_user_turn() -> None:
    cfg = to_config(compose(["prompt.overlong=truncate_left", "sampling.max_tokens=10"]))
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "first answer"},
        {"role": "user", "content": TEXT},
    ]
    tok = WordTokenizer()
    req = build_request(cfg, PromptBuilder(cfg.prompt), {"messages": messages}, 0, tok.encode)
    text = tok.decode(req.fit("truncate_left", 60))
    head = "<|system|>Be brief.\n<|user|>first question\n<|assistant|>first answer\n<|user|>"
    assert text.startswith(head) and text.endswith("\n" + HEADER)
    assert TEXT.endswith(text[len(head) : -len("\n" + HEADER)])


class TemplateEngine(FakeEngine):
    """The fake engine with the word tokenizer and the header template, and a small window."""

    max_model_len = 100

    def __init__(self) -> None:
        super().__init__()
        self.tok = WordTokenizer()

    def encode(self, prompt: Any, chat_template_kwargs: Any = None) -> list[int]:
        return self.tok.encode(prompt)


def test_the_worker_and_validate_send_and_count_the_cut_chat(tmp_path: Path) -> None:
    corpus = tmp_path / "c.jsonl"
    rows = [{"id": "long", "text": TEXT}, {"id": "short", "text": "w1 w2"}]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    extra = [*LABELS, EXAMPLE, "prompt.overlong=truncate_right", "sampling.max_tokens=10", "input.id_column=id"]
    run = prepare(compose(fake_overrides(tmp_path, corpus, *extra)))
    eng = TemplateEngine()
    run_shards(run, [0], engine=keyed(eng, run))
    merge(run)
    out = read_output(run.path)
    assert [r["error"] for r in out] == [None, None]
    sent = {eng.tok.decode(ids) for ids in eng.added}
    head = fixed_head()
    assert head + "w1 w2\n" + HEADER in sent
    (cut,) = sent - {head + "w1 w2\n" + HEADER}
    assert cut.startswith(head + "w0 w1") and cut.endswith("\n" + HEADER) and len(cut) < len(head + TEXT)
    assert out[0]["prompt_tokens"] <= 90
    # a window the fixed turns fill: both rows are overlong error rows, in the run and in validate
    small = TemplateEngine()
    small.max_model_len = len(WordTokenizer().encode(fixed_head() + "\n" + HEADER))
    (tmp_path / "s").mkdir()
    strict = prepare(compose(fake_overrides(tmp_path / "s", corpus, *extra)))
    run_shards(strict, [0], engine=keyed(small, strict))
    merge(strict)
    assert [r["error"]["kind"] for r in read_output(strict.path)] == ["overlong", "overlong"]
    found = check_rows(strict.config, open_input(strict.input_dir), WordTokenizer(), small.max_model_len)
    assert found.errors.kinds["overlong"]["count"] == 2
