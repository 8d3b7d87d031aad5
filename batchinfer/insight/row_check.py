"""Rows checked as the worker takes them, without an engine: sampling overrides, prompt, tokens,
the overlong policy; a pooling task's text(s) built and tokenized on the login node."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

from batchinfer.config.schema import POOLING_TASKS, Config
from batchinfer.errors import InputError
from batchinfer.insight.findings import Checked

BATCH_ROWS = 1000  # rows in memory at once


def check_rows(
    c: Config,
    ds: Any,
    tok: Any,
    max_len: int,
    rows: Optional[Sequence[int]] = None,
    progress: Optional[Callable[[int], Any]] = None,
) -> Checked:
    """Rows (all by default, in increasing order) as the worker takes them: sampling overrides, prompt,
    tokens, overlong policy; a pooling task's text(s) as PoolingRows builds them."""
    from jinja2.exceptions import TemplateError

    from batchinfer.inputs.openai_batch import task_mismatch
    from batchinfer.requests.bounded import CharBound
    from batchinfer.requests.build import build_request, row_id
    from batchinfer.requests.prompts import PromptBuilder, RowError

    prompt = c.prompt
    builder = PromptBuilder(prompt)
    found = Checked()
    errors, stops, lengths = found.errors, found.stops, found.lengths
    kwargs = prompt.chat_template_kwargs
    pooled = PooledRows(c, tok, max_len) if c.task.name in POOLING_TASKS else None
    bound = CharBound.of(max_len, getattr(tok, "max_token_chars", None))  # as the worker bounds it
    rows = range(len(ds)) if rows is None else rows
    for start in range(0, len(rows), BATCH_ROWS):
        batch = rows[start : start + BATCH_ROWS]
        for index, row in zip(batch, ds.select(batch).to_list(), strict=True):
            example = {"row": index, "id": row_id(c, row, index)}
            try:
                if pooled is not None:
                    why = task_mismatch(row, c.task.name)
                    if why:  # PoolingRows' error row for an OpenAI request of another task
                        errors.add("unsupported", dict(example, message=f"row {index}: {why}"))
                        continue
                    try:
                        pooled.check(builder, row, index)
                    finally:  # counted like a generation prompt: an overlong error row too
                        if pooled.raw:
                            lengths[sum(pooled.raw)] += 1
                            found.overlong += any(n > max_len for n in pooled.raw)
                    continue
                req = build_request(c, builder, row, index, lambda p: tok.encode(p, kwargs), bound)
                lengths[req.tokens] += 1
                found.overlong += req.tokens >= max_len
                req.fit(prompt.overlong, max_len)
            except RowError as e:
                errors.add(e.kind, dict(example, message=f"row {index}: {e.message}"))
            except TemplateError as e:  # the engine's chat template raises the same: the shard would fail
                stops.add("chat_template", dict(example, message=f"row {index}: chat template: {e}"))
            except InputError as e:  # prompt.overlong=fail stops the run
                stops.add("overlong", dict(example, message=f"row {index}: {e}"))
        if progress is not None:
            progress(len(batch))
    return found


class PooledRows:
    """A pooling task's rows as the worker builds them (requests/pooling.py), tokenized on the login
    node: a cross-encoder's score pair as one input, cut as the engine's tokenizer cuts it."""

    def __init__(self, c: Config, tok: Any, max_len: int) -> None:
        from batchinfer.models.pooling import is_cross_encoder
        from batchinfer.models.tokens import model_dir
        from batchinfer.requests.pooling import special_tokens

        self.c, self.tok, self.max_len = c, tok, max_len
        self.kwargs = c.prompt.chat_template_kwargs
        self.raw: list[int] = []  # the last row's texts' token counts (one, two, or a pair's)
        self.around = special_tokens(lambda text: tok.encode(text))
        # vLLM's rule (engine/pooled.py): a classifier scores the pair as one input, an embedder as two
        self.cross = c.task.name == "score" and is_cross_encoder(model_dir(c.model.path or "", c.model.revision))

    def encode_pair(self, query: str, document: str, limit: Optional[int]) -> tuple[list[int], int]:
        """The pair as one input and where the document starts; with limit, the document cut to fit."""
        from batchinfer.requests.prompts import RowError

        t = self.tok.tokenizer
        if limit:
            t.enable_truncation(limit, strategy="only_second")
        try:
            enc = t.encode(query, document)
        except Exception as e:  # the query alone is longer than the limit
            raise RowError("overlong", f"the pair cannot be cut to {limit} tokens: {e}") from None
        finally:
            if limit:
                t.no_truncation()
        return list(enc.ids), enc.type_ids.index(1) if 1 in enc.type_ids else len(enc.ids)

    def check(self, builder: Any, row: dict[str, Any], index: int) -> None:
        """Build the row's request as the worker does: RowError / InputError as it raises them. Its
        texts' token counts before the overlong policy are left in self.raw."""
        from batchinfer.requests.pooling import pooling_request

        self.raw = raw = []

        def encode(prompt: Any) -> list[int]:
            ids = self.tok.encode(prompt, self.kwargs)
            raw.append(len(ids))
            return ids

        def encode_pair(query: str, document: str, limit: Optional[int]) -> tuple[list[int], int]:
            ids, boundary = self.encode_pair(query, document, limit)
            if limit is None:
                raw.append(len(ids))
            return ids, boundary

        pair = encode_pair if self.cross else None
        pooling_request(self.c, builder, row, index, encode, self.max_len, self.around, pair)
