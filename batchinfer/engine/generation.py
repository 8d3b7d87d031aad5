"""Rows of a generation task: the request a row makes and the output row a finished request gives
(pooled.py is the same for embed, classify and score)."""

from __future__ import annotations

import math
from typing import Any, Optional

from batchinfer import faults
from batchinfer.config.schema import Config
from batchinfer.engine.drafted import Drafted, Keyed, RowIn
from batchinfer.engine.encoding import render_all
from batchinfer.engine.phases import CLOCK
from batchinfer.engine.vllm_engine import Completion
from batchinfer.inputs.openai_batch import task_mismatch
from batchinfer.requests.bounded import CharBound
from batchinfer.requests.build import RowRequest, asked_adapter, draft_request, encoded, sampling_for
from batchinfer.requests.image_budget import ImageBudget, NoRoom
from batchinfer.requests.prompts import Prompt, PromptBuilder, RowError
from batchinfer.requests.request import ErrorRow, RequestKey
from batchinfer.requests.verdict import engine_refusal
from batchinfer.rundir.schema import OutputRow, error_row


def _error(index: int, base: OutputRow, e: RowError) -> ErrorRow:
    """A row's error row."""
    return ErrorRow(dict(error_row(index, base["id"], e.kind, f"row {index}: {e.message}"), **base))


class GenerationRows:
    """A generation run's rows <-> engine requests."""

    def __init__(self, cfg: Config, prompts: PromptBuilder):
        self.cfg = cfg
        self.prompts = prompts
        self.poisoned: set[RequestKey] = set()  # fault injection only: requests that kill the engine
        self._params: dict[str, Any] = {}  # own sampling -> the engine's SamplingParams for it
        self._params_engine: Any = None  # the engine those are of

    def request(self, index: int, base: OutputRow, row: dict[str, Any], engine: Any) -> RequestKey | ErrorRow:
        """The row's request key (identical requests share one when sampling is greedy or seeded),
        or its error row."""
        (made,) = self.requests([(index, base, row)], engine)
        if isinstance(made, Exception):
            raise made
        return made

    def requests(self, rows: list[RowIn], engine: Any) -> list[Keyed]:
        """request() of each (index, output base, row), their prompts rendered and tokenized
        together; an exception that is no row's error (prompt.overlong=fail) in its row's place."""
        drafted = self.draft(rows, engine)
        drafted.tokenize()
        return self.finish(drafted, engine)

    def draft(self, rows: list[RowIn], engine: Any, images: Optional[ImageBudget] = None) -> Drafted:
        """The first half of requests(): each row's request without its tokens, its prompt rendered;
        rows' images decoded under `images`, the slice ending before a row whose image has no room."""
        kwargs = self.cfg.prompt.chat_template_kwargs
        bound = CharBound.of(engine.max_model_len, getattr(engine, "max_token_chars", None))

        def encode(p: Prompt) -> list[int]:
            return engine.encode(p, kwargs)

        d = Drafted(rows, [])
        with CLOCK("request"):
            for index, base, row in rows:
                if self.cfg.model.lora.adapters:  # every row's, its error row's too (report counts by it)
                    base["adapter"] = asked_adapter(self.cfg, row)
                why = task_mismatch(row, "generate")
                if why:
                    d.out.append(_error(index, base, RowError("unsupported", why)))
                    continue
                try:
                    d.drafts[len(d.out)] = draft_request(self.cfg, self.prompts, row, index, encode, bound, images)
                    d.out.append(ErrorRow({}))  # its place, until its request is made
                except NoRoom:  # this row and the rest wait for the images held to be sent
                    d.rows = rows[: len(d.out)]
                    break
                except RowError as e:
                    d.out.append(_error(index, base, e))
                except Exception as e:  # raised where this row is taken, as if made alone
                    d.out.append(e)
        d.counted = [k for k, r in d.drafts.items() if r.to_encode]
        d.rendered = render_all(engine, [d.drafts[k].prompt for k in d.counted], kwargs)
        return d

    def finish(self, d: Drafted, engine: Any) -> list[Keyed]:
        """The second half of requests(), once d.tokenize() has counted the prompts' tokens."""
        results = dict(zip(d.counted, d.tokens or [], strict=True))
        with CLOCK("request"):
            for k, req in d.drafts.items():
                index, base, _ = d.rows[k]
                try:
                    if k in results:
                        encoded(req, results[k])
                    d.out[k] = self._key(index, base, req, engine)
                except RowError as e:
                    d.out[k] = _error(index, base, e)
                except Exception as e:
                    d.out[k] = e
        return d.out

    def _key(self, index: int, base: OutputRow, req: RowRequest, engine: Any) -> RequestKey:
        """The request key of a row's request, the overlong policy applied (RowError: its error row)."""
        ids = req.fit(self.cfg.prompt.overlong, engine.max_model_len)
        self.params(engine, req.own)
        if self.cfg.model.lora.adapters:
            base["adapter"] = req.adapter  # the output's adapter column (null: the base model)
        shared = req.sampling["temperature"] == 0 or req.sampling.get("seed") is not None
        image = req.image
        key = RequestKey(
            tuple(ids),
            req.own,
            None if shared else index,
            req.adapter,
            *((image.digest, image.pixels) if image else ()),
        )
        if faults.poisoned(req.prompt):
            self.poisoned.add(key)
        return key

    def params(self, engine: Any, own: str) -> Any:
        """The engine's SamplingParams for a row (one per own sampling, kept); whatever vLLM raises
        on the values (its VLLMValidationError is no ValueError) is RowError, kind sampling."""
        if self._params_engine is not engine:
            self._params, self._params_engine = {}, engine
        if own in self._params:
            return self._params[own]
        try:
            params = engine.sampling_params(sampling_for(self.cfg, own))
        except Exception as e:
            raise engine_refusal(e, "sampling", f"vLLM refuses the row's sampling {own or '(the config)'}") from None
        self._params[own] = params
        return params

    def result_row(self, base: OutputRow, c: Completion) -> OutputRow:
        """An output row from a finished request."""
        row = OutputRow(**base)
        row.update(
            text=c.texts[0] if c.texts else None,
            finish_reason=c.finish_reason,
            prompt_tokens=c.prompt_tokens,
            output_tokens=c.output_tokens,
            error=None,
        )
        if self.cfg.model.lora.adapters:
            row["adapter"] = base.get("adapter")
        if len(c.texts) > 1:
            row["samples"] = c.texts
        if c.reasoning is not None:
            row["reasoning"] = c.reasoning[0] if c.reasoning else None
        labels = self.cfg.prompt.labels
        if labels.names:
            row["label"] = row["text"] if row["text"] in labels.names else None
            if labels.confidence and row["label"] is not None and c.logprob is not None:
                row["label_confidence"] = math.exp(c.logprob)
        return row
