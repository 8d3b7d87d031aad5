"""A prompt far past max_model_len in characters is not tokenized whole (issue 41: a 52 MB field took
validate 121 s and 8.6 GB): its tokens are bounded from below by its characters (the longest token's
characters, models/tokens.py), error_row and fail need no count, and the truncate policies cut a part
of the text that gives the same tokens as cutting the whole."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from batchinfer.config.compose import compose
from batchinfer.config.schema import to_config
from batchinfer.models.tokens import LoginTokenizer
from batchinfer.requests.bounded import CharBound, solid_chars
from batchinfer.requests.build import build_request
from batchinfer.requests.prompts import PromptBuilder, RowError

MAX_LEN = 256
TEXT = "the quick brown fox jumps over the lazy dog. "


class Recording:
    """The login tokenizer, recording how many characters each text it tokenizes has."""

    def __init__(self, tok: LoginTokenizer):
        self.tok, self.sizes = tok, []

    def encode(self, prompt: Any) -> list[int]:
        text, _ = self.tok.prompt_text(prompt)
        self.sizes.append(len(text))
        return self.tok.encode(prompt)


@pytest.fixture(scope="module")
def tok(tiny_model_path: Path) -> LoginTokenizer:
    """The tiny model's login-node tokenizer."""
    return LoginTokenizer.from_model_dir(tiny_model_path)


def _request(tok: LoginTokenizer, text: str, policy: str, mode: str, bounded: bool = True) -> tuple[Any, Recording]:
    c = to_config(compose([f"prompt.overlong={policy}", f"prompt.mode={mode}", "sampling.max_tokens=16"]))
    rec = Recording(tok)
    bound = CharBound.of(MAX_LEN, tok.max_token_chars) if bounded else None
    req = build_request(c, PromptBuilder(c.prompt), {"text": text}, 0, rec.encode, bound)
    return req, rec


def test_the_bound_holds_for_the_model(tok: LoginTokenizer) -> None:
    """The tokens counted are never fewer than the characters say (a text of many kinds of words)."""
    assert tok.max_token_chars and tok.max_token_chars <= 32
    for text in (TEXT * 50, "a" * 5000, "x y " * 2000, "\n\t" * 1000 + "é" * 3000):
        assert len(tok.encode(text)) >= solid_chars(text) // tok.max_token_chars


@pytest.mark.parametrize("mode", ["raw", "chat"])
def test_an_overlong_error_row_is_not_tokenized_at_all(tok: LoginTokenizer, mode: str) -> None:
    """A 4 MB field: error_row says `at least N tokens` and the tokenizer never sees the text."""
    req, rec = _request(tok, TEXT * 90_000, "error_row", mode)
    assert rec.sizes == [] and req.tokens >= MAX_LEN
    with pytest.raises(RowError) as e:
        req.fit("error_row", MAX_LEN)
    assert e.value.kind == "overlong" and f"prompt has at least {req.tokens} tokens" in e.value.message


@pytest.mark.parametrize("mode", ["raw", "chat"])
@pytest.mark.parametrize("policy", ["truncate_left", "truncate_right"])
def test_a_cut_of_a_huge_field_tokenizes_a_bounded_part_and_gives_the_same_tokens(
    tok: LoginTokenizer, mode: str, policy: str
) -> None:
    """Cut from a 4 MB field, the tokenizer sees at most a few times the window's characters; and
    on a text small enough to count whole, the bounded cut is the exact cut, token for token."""
    req, rec = _request(tok, TEXT * 90_000, policy, mode)
    req.fit(policy, MAX_LEN)
    limit = 8 * MAX_LEN * tok.max_token_chars + 200  # the part kept (twice the window) doubled, and the template
    assert rec.sizes and max(rec.sizes) <= limit, (max(rec.sizes), limit)
    text = "".join(f"{w}{i % 97} " for i, w in enumerate(TEXT.split() * 400))  # countable, varied
    bounded, _ = _request(tok, text, policy, mode)
    exact, _ = _request(tok, text, policy, mode, bounded=False)
    assert bounded.at_least and not exact.at_least
    assert bounded.fit(policy, MAX_LEN) == exact.fit(policy, MAX_LEN)


def test_no_bound_where_a_normalizer_may_drop_characters(minilm: Path) -> None:
    """A BERT tokenizer (clean_text, strip_accents, [UNK] for a whole word): no bound, counted exactly."""
    assert LoginTokenizer.from_model_dir(minilm).max_token_chars is None
