"""An input row -> what the engine gets: id, own sampling, prompt tokens. One code path for the
worker and `batchinfer validate`, so validate predicts exactly the error rows a run writes."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from batchinfer.config.schema import Config
from batchinfer.errors import InputError
from batchinfer.inputs.openai_batch import ROW_SAMPLING, task_mismatch
from batchinfer.inputs.textfiles import MAX_JSON_DEPTH, json_depth
from batchinfer.models.image_tokens import model_image_tokens
from batchinfer.requests.bounded import CharBound
from batchinfer.requests.image_budget import ImageBudget
from batchinfer.requests.images import ImageLimits, RowImage, image_column, row_image, with_image
from batchinfer.requests.prompts import Messages, Prompt, PromptBuilder, RowError
from batchinfer.requests.verdict import RULES, Limits, adapter_refusal, limits, refusal

# The keys a row's own sampling may set: SamplingParams names (not seed_per_row, a run's setting).
ROW_KEYS = frozenset({*RULES, "structured_outputs"})
Encode = Callable[[Prompt], list[int]]
TRUNCATE = ("truncate_left", "truncate_right")
MAX_RENDERS = 40  # renders of a chat being cut: halving the gap, a million characters take 20


@dataclass
class RowRequest:
    """A row ready for the engine (its prompt tokens before the overlong policy)."""

    id: Any
    own: str  # the row's own sampling overrides, canonical JSON ("" when none)
    sampling: dict[str, Any]
    prompt: Prompt
    ids: list[int]
    encode: Encode = field(repr=False, compare=False)  # how ids were made: a cut chat is rendered again
    # The prompt is overlong by its characters alone (requests/bounded.py): at least this many tokens,
    # not counted; ids are empty (error_row, fail), or of its cut text (truncate_left, truncate_right).
    at_least: Optional[int] = None
    adapter: Optional[str] = None  # the LoRA adapter's name (model.lora.adapters); None: the base model
    to_encode: bool = True  # its ids are the prompt's tokens (False: error_row and fail need no count)
    image: Optional[RowImage] = None  # the row's image (prompt.image_column), decoded
    # The tokens the image adds beyond its one placeholder in ids (models/image_tokens.py: the
    # engine's processor expands it); 0 where the model's files do not say.
    image_tokens: int = 0

    @property
    def tokens(self) -> int:
        """The prompt's tokens (its image's expanded): counted, or the fewest it can have."""
        return (self.at_least or len(self.ids)) + self.image_tokens

    def fit(self, policy: str, max_model_len: int) -> list[int]:
        """The token ids to send, prompt.overlong applied (see fit_prompt)."""
        if self.image is not None and (self.at_least or self.tokens >= max_model_len):
            if policy in TRUNCATE:  # cutting would split the image's tokens; its text alone is not cut yet
                raise RowError(
                    "overlong",
                    f"a prompt with an image has {self.tokens} tokens; model.max_model_len is {max_model_len}",
                )
            if not self.at_least:
                msg = (
                    f"prompt has {self.tokens} tokens ({self.image_tokens + 1} of them its "
                    f"{self.image.width}x{self.image.height} image's); model.max_model_len is {max_model_len}"
                )
                fix = f"raise model.max_model_len to {self.tokens + 1} or more (the processor sizes the image)"
                if policy == "fail":
                    raise InputError(f"{msg} (prompt.overlong=fail); {fix}")
                raise RowError("overlong", f"{msg}; {fix}")
        if self.at_least and policy not in TRUNCATE:
            return overlong_tokens(self.ids, policy, max_model_len, self.sampling["max_tokens"], self.at_least)
        return fit_prompt(self.prompt, self.ids, self.encode, policy, max_model_len, self.sampling["max_tokens"])


def row_id(cfg: Config, row: dict[str, Any], index: int) -> Any:
    """The row's id: input.id_column, else its index."""
    column = cfg.input.id_column
    return row[column] if column else index


def sampling_for(cfg: Config, own: str) -> dict[str, Any]:
    """The run's sampling config (SamplingParams names) with a row's own overrides (JSON) on top."""
    return dict(cfg.sampling.params, **json.loads(own)) if own else cfg.sampling.params


def build_request(
    cfg: Config,
    builder: PromptBuilder,
    row: dict[str, Any],
    index: int,
    encode: Encode,
    bound: Optional[CharBound] = None,
) -> RowRequest:
    """Id, sampling, prompt and token ids of a row; a bad row raises RowError. bound: a prompt
    overlong by its characters alone is not tokenized whole (requests/bounded.py)."""
    req = draft_request(cfg, builder, row, index, encode, bound)
    if req.to_encode:
        req.ids = _encode(encode, req.prompt)
    return req


def draft_request(
    cfg: Config,
    builder: PromptBuilder,
    row: dict[str, Any],
    index: int,
    encode: Encode,
    bound: Optional[CharBound] = None,
    images: Optional[ImageBudget] = None,
) -> RowRequest:
    """build_request without counting the prompt's tokens: when `to_encode`, its ids are those of
    `prompt` (set them with `encoded`; the worker tokenizes a window's prompts together); the row's
    image decoded under `images` (NoRoom: not now)."""
    why = task_mismatch(row, cfg.task.name)  # an OpenAI request this run cannot honour
    if why:
        raise RowError("unsupported", why)
    id_ = row_id(cfg, row, index)
    own = row_sampling(cfg, row, id_)
    adapter = row_adapter(cfg, row)
    prompt = builder.build(row)
    image = None
    column = image_column(cfg.prompt, row)
    if column:  # the image first: a row whose image is bad costs no tokenizing
        image = row_image(row, column, ImageLimits.of(cfg.prompt, cfg.input.path), budget=images)
    policy = cfg.prompt.overlong
    at_least = bound.at_least(prompt) if bound is not None else None
    if at_least is not None and policy in TRUNCATE:
        prompt = bound.shorten(prompt, from_end=policy == "truncate_left")
    to_encode = at_least is None or policy in TRUNCATE
    extra = 0
    if image is not None:
        prompt = with_image(prompt)  # after the bound: it measures and cuts text content
        extra = model_image_tokens(cfg.model.path, cfg.model.revision).extra(image.width, image.height)
    req = RowRequest(id_, own, sampling_for(cfg, own), prompt, [], encode, at_least, adapter, to_encode, image)
    req.image_tokens = extra
    return req


def encoded(req: RowRequest, result: Union[list[int], Exception]) -> RowRequest:
    """A draft with its prompt's ids (or what encoding it raised, this row's RowError)."""
    if isinstance(result, Exception):
        raise _template_error(result)
    req.ids = result
    return req


def row_adapter(cfg: Config, row: dict[str, Any]) -> Optional[str]:
    """The row's LoRA adapter: its input.adapter_column value, else model.lora.default (None: the
    base model); a name model.lora.adapters lacks is RowError kind adapter."""
    column = cfg.input.adapter_column
    value = row.get(column) if column else None
    why = adapter_refusal(value, cfg.model.lora.adapters, column) if column else None
    if why:
        raise RowError("adapter", why)
    return value if value is not None else cfg.model.lora.default


def asked_adapter(cfg: Config, row: dict[str, Any]) -> Optional[str]:
    """The adapter a row asks for, known or not (the output's adapter column, error rows' too, so
    `report` counts a row under what it asked for): its input.adapter_column value as text, else
    model.lora.default (None: the base model)."""
    column = cfg.input.adapter_column
    value = row.get(column) if column else None
    return str(value) if value is not None else cfg.model.lora.default


def _encode(encode: Encode, prompt: Prompt) -> list[int]:
    try:
        return encode(prompt)
    except Exception as e:  # the chat template raised on this row's messages (jinja, or a bad message)
        raise _template_error(e) from None


def _template_error(e: Exception) -> RowError:
    """The error of a row whose messages the chat template (or the tokenizer) refused."""
    return RowError("chat_template", f"the chat template rejects this row's messages: {type(e).__name__}: {e}")


def overlong_tokens(
    ids: list[int], policy: str, max_model_len: int, max_tokens: int, at_least: Optional[int] = None
) -> list[int]:
    """Apply prompt.overlong to a prompt vLLM would reject (prompt_tokens >= max_model_len); at_least:
    the tokens it has at least, known from its characters (ids are then not all of its tokens)."""
    if at_least is None and len(ids) < max_model_len:
        return ids
    count = f"at least {at_least} tokens (from its length in characters)" if at_least else f"{len(ids)} tokens"
    msg = f"prompt has {count}; model.max_model_len is {max_model_len}"
    if policy == "fail":
        raise InputError(
            f"{msg} (prompt.overlong=fail); raise model.max_model_len or choose error_row/truncate_left/truncate_right"
        )
    if policy == "error_row":
        raise RowError(
            "overlong", f"{msg}; raise model.max_model_len or set prompt.overlong=truncate_left|truncate_right"
        )
    keep = keep_tokens(max_model_len, max_tokens)
    return ids[-keep:] if policy == "truncate_left" else ids[:keep]


def keep_tokens(max_model_len: int, max_tokens: int) -> int:
    """How long a cut prompt is: room for max_tokens of output, but never less than half the context."""
    return max(max_model_len - max_tokens, max_model_len // 2)


def fit_prompt(
    prompt: Prompt, ids: list[int], encode: Encode, policy: str, max_model_len: int, max_tokens: int
) -> list[int]:
    """prompt.overlong applied: a raw prompt's tokens are cut; a chat's last user turn (the row's own
    text) is cut and the chat rendered again, so the system prompt, examples, labels and the
    generation header stay whole (cutting the rendered tokens would drop them)."""
    if len(ids) < max_model_len or isinstance(prompt, str) or policy not in ("truncate_left", "truncate_right"):
        return overlong_tokens(ids, policy, max_model_len, max_tokens)
    return _cut_chat(prompt, ids, encode, policy == "truncate_left", max_model_len, max_tokens)


def _cut_chat(
    messages: Messages, ids: list[int], encode: Encode, left: bool, max_model_len: int, max_tokens: int
) -> list[int]:
    msg = f"prompt has {len(ids)} tokens; model.max_model_len is {max_model_len}"
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not users:
        raise RowError("overlong", f"{msg}, and the chat has no user turn to cut; raise model.max_model_len")
    turn, text = users[-1], messages[users[-1]]["content"]

    def render(cut: str) -> list[int]:
        return _encode(encode, [*messages[:turn], dict(messages[turn], content=cut), *messages[turn + 1 :]])

    fixed = len(render(""))
    keep = keep_tokens(max_model_len, max_tokens)
    limit = keep if fixed < keep else max_model_len - 1  # the fixed turns are long: fit at all
    # The longest cut that fits: characters in proportion to the tokens that must go (a guess,
    # as characters per token vary), the gap between a fitting and a too long cut halved otherwise.
    fits, too_long, best = 0, len(text), None
    n, cut = len(text), ids
    for _ in range(MAX_RENDERS):
        if len(cut) > limit:
            too_long = n
        else:
            fits, best = n, cut
        if too_long - fits <= 1 or len(cut) == limit or fixed >= limit:
            break
        guess = n * (limit - fixed) // max(len(cut) - fixed, 1)
        n = guess if fits < guess < too_long else (fits + too_long) // 2
        cut = render(text[len(text) - n :] if left else text[:n])
    if best is None or fits == 0:
        raise RowError(
            "overlong",
            f"{msg}; without its last user text the chat alone takes {fixed} tokens (system prompt, examples, "
            "other turns, chat template), so nothing of the row's text fits: raise model.max_model_len or "
            "shorten the fixed turns",
        )
    return best


def row_sampling(cfg: Config, row: dict[str, Any], id_: Any) -> str:
    """A row's own sampling overrides as canonical JSON ("" when none): an OpenAI request's
    fields, input.sampling_column, and the row's seed under sampling.seed_per_row."""
    own: dict[str, Any] = json.loads(row.get(ROW_SAMPLING) or "{}")
    column = cfg.input.sampling_column
    if column and row.get(column) is not None:
        value = row[column]
        if isinstance(value, str):
            deep = value.count("[") + value.count("{") > MAX_JSON_DEPTH and json_depth(value) > MAX_JSON_DEPTH
            if deep:  # Python's recursion would fail the shard further down (hashing, grammar compiling)
                raise RowError(
                    "sampling", f"field {column!r} nests objects and lists past {MAX_JSON_DEPTH} levels; flatten it"
                )
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise RowError("sampling", f"field {column!r} is not a JSON object: {e}") from None
        if not isinstance(value, dict):
            raise RowError("sampling", f"field {column!r} must be an object of SamplingParams, got {value!r}")
        value = _set_keys(value)
        unknown = sorted(set(value) - ROW_KEYS)
        if unknown:
            raise RowError("sampling", f"field {column!r} has unknown sampling keys {unknown}")
        own.update(value)
    for key in cfg.input.sampling_overridden:  # the config's value wins (a redo's overrides)
        own.pop(key, None)
    if cfg.sampling.n == 1 and isinstance(own.get("n"), int) and own["n"] > 1 and not row.get(ROW_SAMPLING):
        raise RowError(
            "sampling",
            f"field {column!r} asks for n={own['n']} samples, but this run keeps one per row (sampling.n=1): "
            "set sampling.n>1 in the config to keep a samples column, or drop n from the row",
        )
    where = f"field {column!r}" if column and row.get(column) is not None else "the request's body"
    check_row_sampling(cfg, own, where)
    s = cfg.sampling
    if s.seed_per_row and "seed" not in own:
        own["seed"] = row_seed(s.seed, id_)
    return json.dumps(own, sort_keys=True) if own else ""


def _set_keys(value: dict[str, Any]) -> dict[str, Any]:
    """A row's sampling object without its null values, structured_outputs' own included: null is
    unset for SamplingParams, and where the column is an Arrow struct a key another row has reads as
    null in this one (its keys are every row's)."""
    kept = {k: v for k, v in value.items() if v is not None}
    if isinstance(kept.get("structured_outputs"), dict):
        kept["structured_outputs"] = {k: v for k, v in kept["structured_outputs"].items() if v is not None}
    return kept


def check_row_sampling(cfg: Config, own: dict[str, Any], where: str) -> None:
    """RowError (kind sampling) naming the key when vLLM would refuse the row's request: its own
    sampling values on top of the config's (requests/verdict.py holds vLLM's rules)."""
    if not own:
        return  # the config's own values were checked before the run started
    # a json schema string is a path only in the config's own structured_outputs (frozen into DIR)
    found = refusal(dict(cfg.sampling.params, **own), row_limits(cfg), in_row="structured_outputs" in own)
    if found:
        source = where if found.key.split(".")[0] in own else "the row's sampling with the config's"
        raise RowError("sampling", found.message(f"{source}: "))


def row_limits(cfg: Config) -> Limits:
    """The limits a run's model sets on each request (see requests/verdict.py)."""
    m = cfg.model
    return limits(m.path, m.revision, m.engine_kwargs, m.compact_json)


def row_seed(seed: int, id_: Any) -> int:
    """A row's own seed: stable across runs, shards and resumes; 31 bits, as every backend takes."""
    digest = hashlib.blake2b(f"{seed}:{id_!r}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & 0x7FFFFFFF
