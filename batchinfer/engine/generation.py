"""Rows of a generation task: the request a row makes and the output row a finished request gives
(pooled.py is the same for embed, classify and score)."""

from __future__ import annotations

import math
from typing import Any

from batchinfer import faults
from batchinfer.config.schema import Config
from batchinfer.engine.vllm_engine import Completion
from batchinfer.inputs.openai_batch import task_mismatch
from batchinfer.requests.bounded import CharBound
from batchinfer.requests.build import build_request, sampling_for
from batchinfer.requests.prompts import PromptBuilder, RowError
from batchinfer.requests.request import ErrorRow, RequestKey
from batchinfer.requests.verdict import engine_refusal
from batchinfer.rundir.schema import OutputRow, error_row


class GenerationRows:
    """A generation run's rows <-> engine requests."""

    def __init__(self, cfg: Config, prompts: PromptBuilder):
        self.cfg = cfg
        self.prompts = prompts
        self.poisoned: set[RequestKey] = set()  # fault injection only: requests that kill the engine

    def request(self, index: int, base: OutputRow, row: dict[str, Any], engine: Any) -> RequestKey | ErrorRow:
        """The row's request key (identical requests share one when sampling is greedy or seeded),
        or its error row."""
        why = task_mismatch(row, "generate")
        if why:
            return ErrorRow(dict(error_row(index, base["id"], "unsupported", f"row {index}: {why}"), **base))
        kwargs = self.cfg.prompt.chat_template_kwargs
        try:
            bound = CharBound.of(engine.max_model_len, getattr(engine, "max_token_chars", None))
            req = build_request(self.cfg, self.prompts, row, index, lambda p: engine.encode(p, kwargs), bound)
            ids = req.fit(self.cfg.prompt.overlong, engine.max_model_len)
            self.params(engine, req.own)
        except RowError as e:
            return ErrorRow(dict(error_row(index, base["id"], e.kind, f"row {index}: {e.message}"), **base))
        if self.cfg.model.lora.adapters:
            base["adapter"] = req.adapter  # the output's adapter column (null: the base model)
        shared = req.sampling["temperature"] == 0 or req.sampling.get("seed") is not None
        key = RequestKey(tuple(ids), req.own, None if shared else index, req.adapter)
        if faults.poisoned(req.prompt):
            self.poisoned.add(key)
        return key

    def params(self, engine: Any, own: str) -> Any:
        """The engine's SamplingParams for a row; whatever vLLM raises on the values (its
        VLLMValidationError is no ValueError) is RowError, kind sampling."""
        try:
            return engine.sampling_params(sampling_for(self.cfg, own))
        except Exception as e:
            raise engine_refusal(e, "sampling", f"vLLM refuses the row's sampling {own or '(the config)'}") from None

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
