"""A prompt far past max_model_len in characters needs no exact token count to be overlong. Each
character that is not whitespace stays in some token (models/tokens.py: max_token_chars says when that
holds, and how many characters one token can stand for at most, L), so a text of C such characters
has at least C / L tokens. Such a prompt is not tokenized whole (a 52 MB field took validate 121 s
and 8.6 GB): error_row and fail need no count, and the truncate policies cut a part of the text
that still holds twice max_model_len tokens, from the end they keep, before tokenizing it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from batchinfer.requests.prompts import Prompt

# Every character str.isspace() is true of (a tokenizer may drop any of them).
WHITESPACE = tuple(
    "\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f \x85\xa0\u1680"
    + "".join(map(chr, range(0x2000, 0x200B)))
    + "\u2028\u2029\u202f\u205f\u3000"
)


def solid_chars(text: str) -> int:
    """Characters of text that are not whitespace (counted without a copy of the text)."""
    return len(text) - sum(text.count(w) for w in WHITESPACE if w in text)


def cut_solid(text: str, n: int, from_end: bool) -> str:
    """The shortest head (or tail) of text holding at least n characters that are not whitespace,
    found by doubling: each look copies at most twice the part kept."""
    size = n
    while size < len(text):
        part = text[-size:] if from_end else text[:size]
        if solid_chars(part) >= n:
            return part
        size *= 2
    return text


@dataclass(frozen=True)
class CharBound:
    """The tokens a prompt has at least, from its characters, against the model's window."""

    max_model_len: int
    token_chars: int  # the most characters one token stands for

    @classmethod
    def of(cls, max_model_len: int, token_chars: Optional[int]) -> Optional[CharBound]:
        """The bound, or None when the tokenizer gives none."""
        return cls(max_model_len, token_chars) if token_chars else None

    def at_least(self, prompt: Prompt) -> Optional[int]:
        """The fewest tokens the prompt can have, when that many are max_model_len or more; else None
        (it may fit: count it exactly). The chat template only adds tokens."""
        texts = [prompt] if isinstance(prompt, str) else [m["content"] for m in prompt]
        if sum(map(len, texts)) < self.max_model_len * self.token_chars:
            return None  # too short to prove anything: no need to count its whitespace
        fewest = sum(map(solid_chars, texts)) // self.token_chars
        return fewest if fewest >= self.max_model_len else None

    def shorten(self, prompt: Prompt, from_end: bool) -> Prompt:
        """The prompt's text (a chat's last user turn, the part a chat is cut in) cut to a head or tail
        that still holds at least twice max_model_len tokens: cutting it to the window gives the
        tokens cutting the whole text would give."""
        n = 2 * self.max_model_len * self.token_chars
        if isinstance(prompt, str):
            return cut_solid(prompt, n, from_end)
        users = [i for i, m in enumerate(prompt) if m["role"] == "user"]
        if not users:
            return prompt
        i = users[-1]
        return [*prompt[:i], dict(prompt[i], content=cut_solid(prompt[i]["content"], n, from_end)), *prompt[i + 1 :]]
