"""Prompts to token ids as vLLM makes them: a chat rendered with the model's chat template, then
tokenized without special tokens (the template wrote them); a raw prompt tokenized with them. A
slice's prompts are rendered (Python, under the GIL), then tokenized in one call of the fast
tokenizer, which releases the GIL: the worker runs that call on a thread of its own while it renders
the next slice and feeds the engine (ahead.py), and the tokenizer spreads it over the task's cores."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from batchinfer.engine.phases import CLOCK
from batchinfer.requests.prompts import Prompt, RowError

Encoded = Union[list[int], Exception]  # a prompt's token ids, or what rendering or tokenizing it raised


def render(tokenizer: Any, messages: Any, chat_template_kwargs: Optional[dict[str, Any]] = None) -> str:
    """A chat as the text vLLM tokenizes: the chat template with the generation prompt."""
    kw = chat_template_kwargs or {}
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)


def encode_one(tokenizer: Any, prompt: Prompt, chat_template_kwargs: Optional[dict[str, Any]] = None) -> list[int]:
    """One prompt's token ids (what a slice's Rendered.tokens() gives it)."""
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt))
    return list(tokenizer.encode(render(tokenizer, prompt, chat_template_kwargs), add_special_tokens=False))


@dataclass
class Rendered:
    """A slice's prompts rendered to the texts their tokens are counted from. `tokens()` (on any
    thread: it touches only this record and the tokenizer) gives each prompt's ids, in order."""

    tokenizer: Any
    n: int  # prompts in the slice
    raw: list[tuple[int, str]] = field(default_factory=list)  # raw prompts: tokenized with special tokens
    chats: list[tuple[int, str]] = field(default_factory=list)  # rendered chats: tokenized without
    done: dict[int, Encoded] = field(default_factory=dict)  # known already: a refused chat's exception

    def tokens(self) -> list[Encoded]:
        """Each prompt's token ids (or its exception)."""
        out: list[Encoded] = [[] for _ in range(self.n)]
        out_of = {**self.done}
        with CLOCK("tokenize"):
            for group, special in ((self.raw, True), (self.chats, False)):
                texts = [t for _, t in group]
                out_of.update(zip((i for i, _ in group), _tokenize_all(self.tokenizer, texts, special), strict=True))
        for i, ids in out_of.items():
            out[i] = ids
        return out


def render_many(
    tokenizer: Any, prompts: Sequence[Prompt], chat_template_kwargs: Optional[dict[str, Any]] = None
) -> Rendered:
    """The prompts rendered, their tokens not yet counted; a chat its template refuses gets the
    exception (that row's error, not the slice's)."""
    out = Rendered(tokenizer, len(prompts))
    chats = [i for i, p in enumerate(prompts) if not isinstance(p, str)]
    out.raw = [(i, p) for i, p in enumerate(prompts) if isinstance(p, str)]
    with CLOCK("render"):
        for i, text in zip(
            chats, _render_all(tokenizer, [prompts[i] for i in chats], chat_template_kwargs), strict=True
        ):
            if isinstance(text, Exception):
                out.done[i] = text
            else:
                out.chats.append((i, text))
    return out


def render_all(
    engine: Any, prompts: Sequence[Prompt], chat_template_kwargs: Optional[dict[str, Any]] = None
) -> Rendered:
    """The engine's render_many of the prompts; an engine without one (the unit tests' fakes)
    encodes each prompt alone, at once."""
    many = getattr(engine, "render_many", None)
    if many is not None:
        return many(prompts, chat_template_kwargs)
    out = Rendered(None, len(prompts))
    for i, prompt in enumerate(prompts):
        try:
            out.done[i] = engine.encode(prompt, chat_template_kwargs)
        except Exception as e:  # this prompt's own (a chat template that refuses its messages)
            out.done[i] = e
    return out


def _render_all(tokenizer: Any, chats: list[Any], kwargs: Optional[dict[str, Any]]) -> list[Union[str, Exception]]:
    """The chats' texts, rendered in one call; when one of them fails it, each alone (so the
    exception is that chat's)."""
    if not chats:
        return []
    try:
        texts = render(tokenizer, chats, kwargs)
        if isinstance(texts, list) and len(texts) == len(chats) and all(isinstance(t, str) for t in texts):
            return texts
    except Exception:  # some chat's own fault: found below
        pass
    out: list[Union[str, Exception]] = []
    for chat in chats:
        try:
            out.append(render(tokenizer, chat, kwargs))
        except Exception as e:  # the chat template raised on this chat (jinja, or a bad message)
            out.append(e)
    return out


def _tokenize_all(tokenizer: Any, texts: list[str], special: bool) -> list[Encoded]:
    """tokenize(), or where the batch call fails, each text alone (so the exception is that text's)."""
    try:
        return list(tokenize(tokenizer, texts, special))
    except Exception:
        pass
    out: list[Encoded] = []
    for text in texts:
        try:
            out.append(list(tokenizer.encode(text, add_special_tokens=special)))
        except Exception as e:
            out.append(e)
    return out


def tokenize(tokenizer: Any, texts: list[str], special: bool) -> list[list[int]]:
    """Token ids of texts, each as tokenizer.encode(text, add_special_tokens=special) gives them:
    in one batch call of the fast tokenizer's backend where that is the call encode makes."""
    if not texts:
        return []
    backend = _plain_backend(tokenizer)
    if backend is None:
        return [list(tokenizer.encode(t, add_special_tokens=special)) for t in texts]
    return [e.ids for e in backend.encode_batch(texts, add_special_tokens=special)]


def _plain_backend(tokenizer: Any) -> Optional[Any]:
    """The `tokenizers.Tokenizer` that tokenizer.encode hands each text to unchanged, or None: a
    class of its own (or a wrapper) that decides the ids in Python, truncation or padding set on
    the backend, or special-token splitting that transformers would switch before the call."""
    try:
        from transformers import TokenizersBackend
    except ImportError:  # transformers 4: PreTrainedTokenizerFast, encoded text by text
        return None
    cls = type(tokenizer)
    if not isinstance(tokenizer, TokenizersBackend):
        return None
    if cls.encode is not TokenizersBackend.encode or cls._encode_plus is not TokenizersBackend._encode_plus:
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or backend.truncation is not None or backend.padding is not None:
        return None
    if backend.encode_special_tokens != bool(getattr(tokenizer, "split_special_tokens", False)):
        return None
    return backend


def encode_pair(tokenizer: Any, query: str, document: str, limit: Optional[int] = None) -> tuple[list[int], int]:
    """A (query, document) pair as one cross-encoder input and where the document starts;
    with limit, the document is cut to fit (the query is kept whole)."""
    kw: dict[str, Any] = {"truncation": "only_second", "max_length": limit} if limit else {}
    try:
        enc = tokenizer(query, document, **kw)
    except Exception as e:  # the query alone is longer than the limit
        raise RowError("overlong", f"the pair cannot be cut to {limit} tokens: {e}") from None
    types = enc.get("token_type_ids") or []
    return list(enc["input_ids"]), types.index(1) if 1 in types else len(enc["input_ids"])
