"""Rows of a pooling task (embed, classify, score): the request a row makes and the output row a
finished request gives. The worker's streaming, dedup, commits and signals are the same as for
generation; only these two ends differ."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from batchinfer.config.schema import POOLING_TASKS, Config
from batchinfer.engine.drafted import Drafted, Keyed, RowIn
from batchinfer.engine.vllm_engine import Completion
from batchinfer.errors import InputError
from batchinfer.inputs.openai_batch import task_mismatch
from batchinfer.models.pooling import class_labels
from batchinfer.models.tokens import model_dir
from batchinfer.requests.pooling import pooling_request, special_tokens
from batchinfer.requests.prompts import PromptBuilder, RowError
from batchinfer.requests.request import ErrorRow, RequestKey
from batchinfer.rundir.schema import OutputRow, error_row


class PoolingRows:
    """A pooling run's rows <-> engine requests."""

    def __init__(self, cfg: Config, prompts: PromptBuilder, labels: Optional[list[str]] = None):
        self.cfg = cfg
        self.task = cfg.task
        self.prompts = prompts
        self.labels = labels or []  # classify: the model's id2label, in class order
        self._around: Optional[tuple[list[int], list[int]]] = None
        self.poisoned: set[RequestKey] = set()  # fault injection poisons generation prompts only

    def request(self, index: int, base: OutputRow, row: dict[str, Any], engine: Any) -> RequestKey | ErrorRow:
        """The row's request key (identical texts share one: pooling is deterministic), or its error row."""
        if self._around is None:
            self._around = special_tokens(engine.encode)
        why = task_mismatch(row, self.task.name)
        if why:
            return ErrorRow(dict(error_row(index, base["id"], "unsupported", f"row {index}: {why}"), **base))
        # vLLM's rule: a model that embeds scores as a bi-encoder, a classifier as a cross-encoder
        cross = self.task.name == "score" and "embed" not in engine.pooling_tasks
        try:
            ids, extras = pooling_request(
                self.cfg,
                self.prompts,
                row,
                index,
                engine.encode,
                engine.max_model_len,
                self._around,
                engine.encode_pair if cross else None,
            )
            self.params(engine, extras)
        except RowError as e:
            return ErrorRow(dict(error_row(index, base["id"], e.kind, f"row {index}: {e.message}"), **base))
        except ValueError as e:  # refused for another reason than its length (which is a RowError)
            return ErrorRow(dict(error_row(index, base["id"], "rejected", f"row {index}: {e}"), **base))
        return RequestKey(tuple(ids), extras)

    def requests(self, rows: list[RowIn], engine: Any) -> list[Keyed]:
        """request() of each (index, output base, row); an exception that is no row's error (a task
        the model cannot run) in its row's place."""
        return self.finish(self.draft(rows, engine), engine)

    def draft(self, rows: list[RowIn], engine: Any, images: Any = None) -> Drafted:
        """Every row's request made at once (texts are tokenized one by one, pairs among them);
        pooling rows have no images (`images` unused)."""
        d = Drafted(rows, [])
        for index, base, row in rows:
            try:
                d.out.append(self.request(index, base, row, engine))
            except Exception as e:  # raised where this row is taken, as if made alone
                d.out.append(e)
        return d

    def finish(self, d: Drafted, engine: Any) -> list[Keyed]:
        """The rows' requests (made by draft: nothing waits for a tokenizer call)."""
        return d.out

    def params(self, engine: Any, extras: str) -> Any:
        """The engine's PoolingParams for a request; a task the model cannot run fails the shard."""
        try:
            return engine.pooling_params(self.task.name, self.task.dimensions, extras)
        except ValueError as e:
            raise InputError(f"task={self.task.name} with model.path {self.cfg.model.path}: {e}") from None

    def result_row(self, base: OutputRow, c: Completion) -> OutputRow:
        """An output row from a finished pooling request."""
        row = OutputRow(**base)
        row.update(prompt_tokens=c.prompt_tokens, error=None)
        vector = np.asarray(c.pooled, dtype=np.float32)
        if self.task.name == "embed":
            row["embedding"] = vector
        elif self.task.name == "classify":
            row["probs"] = vector
            top = int(vector.argmax()) if len(vector) else None
            keep = top is not None and (self.task.min_prob is None or vector[top] >= self.task.min_prob)
            row["label"] = self.labels[top] if keep and top < len(self.labels) else None  # type: ignore[operator]
        else:
            row["score"] = float(vector[0])
        return row

    @staticmethod
    def cost(c: Completion) -> int:
        """Bytes a finished result holds in the dedup cache."""
        return int(np.asarray(c.pooled).nbytes) if c.pooled is not None else 0


def pooling_rows(cfg: Config, prompts: PromptBuilder) -> Optional[PoolingRows]:
    """The pooling side of a run's rows; None for a generation run."""
    if cfg.task.name not in POOLING_TASKS:
        return None
    labels = None
    if cfg.task.name == "classify":
        labels = class_labels(model_dir(cfg.model.path or "", cfg.model.revision))
    return PoolingRows(cfg, prompts, labels)
