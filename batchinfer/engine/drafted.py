"""A slice of rows on its way to engine requests, made in two halves around its tokenizer call: the
Python half (template, sampling, chat rendering) and, after `tokenize()` (which the worker runs on a
thread of its own: the tokenizer releases the GIL), the requests' keys."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

from batchinfer.engine.encoding import Encoded, Rendered
from batchinfer.requests.build import RowRequest
from batchinfer.requests.request import ErrorRow, Made, RequestKey
from batchinfer.rundir.schema import OutputRow

RowIn = tuple[int, OutputRow, dict[str, Any]]  # a row's index, its output row's base, the input row
Keyed = Union[RequestKey, ErrorRow, Exception]  # a row's request key, its error row, or what making it raised


@dataclass
class Drafted:
    """A slice's rows: each one's error row (or exception) where known already, the requests whose
    prompts wait for their tokens, and those prompts rendered."""

    rows: list[RowIn]
    out: list[Keyed]  # in row order; a drafted row's place holds a placeholder until finished
    drafts: dict[int, RowRequest] = field(default_factory=dict)  # position -> request without its ids
    counted: list[int] = field(default_factory=list)  # positions whose prompt is tokenized (in `rendered`)
    rendered: Rendered = field(default_factory=lambda: Rendered(None, 0))
    tokens: Optional[list[Encoded]] = None  # set by tokenize()

    def tokenize(self) -> None:
        """Count the rendered prompts' tokens (any thread: it touches this record and the tokenizer)."""
        self.tokens = self.rendered.tokens()


@dataclass
class SliceDraft:
    """The worker's half-made slice: each row's place (or what building its output base raised) and
    the task's draft of the rest."""

    out: list[Union[Made, Exception]]  # in row order; placeholders where `drafted` makes the row
    places: list[int]  # positions in `out` of drafted's rows, in its order
    drafted: Drafted

    def tokenize(self) -> None:
        """Count the rendered prompts' tokens (on any thread)."""
        self.drafted.tokenize()
