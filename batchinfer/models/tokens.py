"""Login-node token counts: `tokenizers` + `jinja2`, the way vLLM counts, without torch or transformers."""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

from batchinfer.errors import ConfigError
from batchinfer.models.model_files import lfs_pointer_error, read_model_json

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def model_dir(path: str, revision: Optional[str] = None) -> Path:
    """The local folder of model.path: a folder as it is, a hub name from the local HF cache."""
    from batchinfer.models.locations import looks_local, resolve_model

    resolved, rev = resolve_model(path, revision)  # errors name the path and how to get it
    if looks_local(resolved):
        return Path(resolved)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(resolved, revision=rev, local_files_only=True))


def _token_text(value: Any) -> Optional[str]:
    # tokenizer_config.json writes special tokens as a string or as an AddedToken dict.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _pick_template(value: Any) -> Optional[str]:
    # A list of named templates (older tokenizer_config.json): the one named "default".
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default")
    return value if isinstance(value, str) else None


def find_chat_template(folder: Path, tokenizer_config: dict[str, Any]) -> Optional[str]:
    """The chat template as transformers picks it: chat_template.jinja, tokenizer_config, chat_template.json."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _pick_template(tokenizer_config.get("chat_template"))
    if template:
        return template
    json_file = folder / "chat_template.json"
    if json_file.is_file():
        return _pick_template(read_model_json(json_file).get("chat_template"))
    return None


def compile_template(template: str) -> Any:
    """Compile a chat template in the sandboxed environment transformers uses (same globals and filters)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        # {% generation %} marks assistant turns for training masks; rendering keeps its body as it is.
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
    ) -> str:
        # Jinja's own tojson escapes HTML characters, which would change the prompt.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)


# Normalizers that never delete a character that is not whitespace (StripAccents, BertNormalizer's
# clean_text and SentencePiece's Precompiled can): under them each such character of a text stays in
# some token, so a text of C of them has at least C / (the longest token's characters) tokens.
KEEP_CHARACTERS = frozenset({"NFC", "NFKC", "NFD", "NFKD", "Lowercase", "Prepend", "Strip", "Sequence", "Replace"})


def _keeps_characters(normalizer: Any) -> bool:
    if normalizer is None:
        return True
    kind = normalizer.get("type")
    if kind not in KEEP_CHARACTERS or (kind == "Replace" and not normalizer.get("content")):
        return False
    return all(_keeps_characters(n) for n in normalizer.get("normalizers") or [])


def max_token_chars(tokenizer_json: str, vocab: Any) -> Optional[int]:
    """The most characters of a text one token can stand for, from a fast tokenizer's JSON and its
    vocabulary (added tokens too); None when no such bound holds: a normalizer that deletes
    characters, or unknown characters fused into one token (BPE's fuse_unk without byte fallback,
    Unigram). A WordPiece word it does not know is one [UNK] of up to max_input_chars_per_word."""
    spec = json.loads(tokenizer_json)
    model = spec.get("model") or {}
    if not _keeps_characters(spec.get("normalizer")):
        return None
    longest = max((len(t) for t in vocab), default=0)
    if model.get("type") == "BPE" and (model.get("byte_fallback") or not model.get("fuse_unk")):
        return longest or None
    if model.get("type") == "WordPiece":
        return max(longest, int(model.get("max_input_chars_per_word") or 100))
    return None


def hf_max_token_chars(tokenizer: Any) -> Optional[int]:
    """max_token_chars of a transformers fast tokenizer (the engine's); None for a slow one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    return max_token_chars(backend.to_str(), backend.get_vocab(with_added_tokens=True))


class LoginTokenizer:
    """A model's tokenizer.json and chat template, counting prompt tokens as vLLM does."""

    def __init__(self, tokenizer: Any, tokenizer_config: dict[str, Any], chat_template: Optional[str]):
        self.tokenizer = tokenizer
        self.config = tokenizer_config
        self.chat_template = chat_template
        self._compiled = compile_template(chat_template) if chat_template else None
        self.special_tokens = {
            k: t for k in SPECIAL_TOKEN_KEYS if (t := _token_text(tokenizer_config.get(k))) is not None
        }

    @classmethod
    def from_model_dir(cls, path: Path | str) -> LoginTokenizer:
        """Load tokenizer.json, tokenizer_config.json and the chat template of a model folder."""
        from tokenizers import Tokenizer

        folder = Path(path)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise ConfigError(
                f"{folder}: no tokenizer.json (a fast tokenizer is needed to count tokens on the login node)"
            )
        cfg_file = folder / "tokenizer_config.json"
        config = read_model_json(cfg_file) if cfg_file.is_file() else {}
        try:
            tok = Tokenizer.from_file(str(tok_file))
        except Exception as e:  # `tokenizers` raises its own untyped Exception for a file it cannot read
            raise lfs_pointer_error(tok_file) or ConfigError(
                f"{tok_file}: not a tokenizer the `tokenizers` library reads ({e}); copy the model folder again"
            ) from None
        # A tokenizer.json may carry fixed padding and truncation (sentence-transformers folders pad
        # to 128): counts must be of the text itself, as vLLM's tokenizer gives them.
        tok.no_padding()
        tok.no_truncation()
        import jinja2

        try:
            return cls(tok, config, find_chat_template(folder, config))
        except jinja2.TemplateSyntaxError as e:
            jinja = folder / "chat_template.jinja"
            where = f"{jinja}:{e.lineno}" if jinja.is_file() else f"{folder}: the chat template's line {e.lineno}"
            raise ConfigError(
                f"{where}: the chat template does not compile ({e.message}); fix it or use prompt.mode=raw"
            ) from None

    @functools.cached_property
    def max_token_chars(self) -> Optional[int]:
        """The most characters one token stands for (see max_token_chars); None: no bound."""
        return max_token_chars(self.tokenizer.to_str(), self.tokenizer.get_vocab(with_added_tokens=True))

    def render(self, messages: list[dict[str, Any]], chat_template_kwargs: Optional[dict[str, Any]] = None) -> str:
        """The chat template rendered to text with the generation prompt, as apply_chat_template(tokenize=False)."""
        if self._compiled is None:
            raise ConfigError("the model has no chat template: use prompt.mode=raw")
        kwargs = {**self.special_tokens, **(chat_template_kwargs or {})}
        return self._compiled.render(
            messages=messages, tools=None, documents=None, add_generation_prompt=True, **kwargs
        )

    def count_chat(self, messages: list[dict[str, Any]], chat_template_kwargs: Optional[dict[str, Any]] = None) -> int:
        """Prompt tokens of a chat: template rendered, then encoded without special tokens (the template has them)."""
        return self.count(messages, chat_template_kwargs)

    def count_raw(self, text: str) -> int:
        """Prompt tokens of a raw text prompt: encoded with special tokens, as vLLM does for a text prompt."""
        return self.count(text)

    def prompt_text(self, prompt: Any, chat_template_kwargs: Optional[dict[str, Any]] = None) -> tuple[str, bool]:
        """The text vLLM tokenizes for a built prompt, and whether special tokens are added to it."""
        if isinstance(prompt, str):
            # tokenizer.json's post-processor decides BOS/EOS: transformers 5 ignores tokenizer_config's
            # add_bos_token/add_eos_token whenever a tokenizer.json exists.
            return prompt, True
        return self.render(prompt, chat_template_kwargs), False  # the template has the special tokens

    def encode(self, prompt: Any, chat_template_kwargs: Optional[dict[str, Any]] = None) -> list[int]:
        """Token ids of a built prompt, as vLLM makes them: a str is raw, a list of messages is a chat."""
        text, special = self.prompt_text(prompt, chat_template_kwargs)
        return self.tokenizer.encode(text, add_special_tokens=special).ids

    def count(self, prompt: Any, chat_template_kwargs: Optional[dict[str, Any]] = None) -> int:
        """Prompt tokens of a built prompt."""
        return len(self.encode(prompt, chat_template_kwargs))
