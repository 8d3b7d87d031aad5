"""Prompts to token ids as vLLM makes them: a chat rendered with the model's chat template, then
tokenized without special tokens (the template wrote them); a raw prompt tokenized with them. A
window's prompts are rendered and tokenized together: the tokenizer's batch call releases the GIL
(so the worker's main thread keeps the engine fed meanwhile) and spreads over the task's cores."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional, Union

from batchinfer.engine.phases import CLOCK
from batchinfer.requests.prompts import Prompt

Encoded = Union[list[int], Exception]  # a prompt's token ids, or what rendering it raised


def render(tokenizer: Any, messages: Any, chat_template_kwargs: Optional[dict[str, Any]] = None) -> str:
    """A chat as the text vLLM tokenizes: the chat template with the generation prompt."""
    kw = chat_template_kwargs or {}
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)


def encode_one(tokenizer: Any, prompt: Prompt, chat_template_kwargs: Optional[dict[str, Any]] = None) -> list[int]:
    """One prompt's token ids (what encode_many gives it)."""
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt))
    return list(tokenizer.encode(render(tokenizer, prompt, chat_template_kwargs), add_special_tokens=False))


def encode_all(
    engine: Any, prompts: Sequence[Prompt], chat_template_kwargs: Optional[dict[str, Any]] = None
) -> list[Encoded]:
    """The engine's encode_many of the prompts; an engine without one (the unit tests' fakes)
    encodes each prompt alone."""
    if not prompts:
        return []
    many = getattr(engine, "encode_many", None)
    if many is not None:
        return list(many(prompts, chat_template_kwargs))
    out: list[Encoded] = []
    for prompt in prompts:
        try:
            out.append(engine.encode(prompt, chat_template_kwargs))
        except Exception as e:  # this prompt's own (a chat template that refuses its messages)
            out.append(e)
    return out


def encode_many(
    tokenizer: Any, prompts: Sequence[Prompt], chat_template_kwargs: Optional[dict[str, Any]] = None
) -> list[Encoded]:
    """Token ids of each prompt, as encode_one makes them; a chat its template refuses gets the
    exception instead (that row's error, not the window's)."""
    out: list[Encoded] = [[] for _ in prompts]
    raw = [i for i, p in enumerate(prompts) if isinstance(p, str)]
    chats = [i for i, p in enumerate(prompts) if not isinstance(p, str)]
    texts: dict[int, str] = {i: prompts[i] for i in raw}  # type: ignore[misc]
    with CLOCK("render"):
        for i, text in zip(
            chats, _render_all(tokenizer, [prompts[i] for i in chats], chat_template_kwargs), strict=True
        ):
            if isinstance(text, Exception):
                out[i] = text
            else:
                texts[i] = text
    with CLOCK("tokenize"):
        for group, special in ((raw, True), ([i for i in chats if i in texts], False)):
            for i, ids in zip(group, _tokenize_all(tokenizer, [texts[i] for i in group], special), strict=True):
                out[i] = ids
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
