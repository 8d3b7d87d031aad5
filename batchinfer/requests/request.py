"""What a row becomes for the worker: a request for the engine (with the key that says which rows
share its result) or, for a bad row, its error row at once."""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Union


class RequestKey(NamedTuple):
    """A request's identity: rows whose keys are equal are computed once."""

    ids: tuple[int, ...]  # prompt token ids
    own: str  # the row's own sampling (canonical JSON, "" when none), or a pooling request's extras
    # None: identical requests share one result (greedy or seeded sampling, pooling); else the row
    # this request belongs to alone (random sampling: each row its own sample)
    own_row: Optional[int] = None
    adapter: Optional[str] = None  # the LoRA adapter (model.lora.adapters); None: the base model

    @property
    def shared(self) -> bool:
        """Whether identical requests may take this one's result (within and across windows)."""
        return self.own_row is None

    def digest(self) -> bytes:
        """The request's identity in the result cache and crash records: token ids, own sampling, adapter."""
        return request_digest(self.ids, self.own, self.adapter)


def request_digest(ids: Any, own: str, adapter: Optional[str] = None) -> bytes:
    """A digest of prompt token ids, a row's own sampling and its LoRA adapter (the base model's
    digest is as before adapters existed)."""
    h = hashlib.blake2b(array("q", ids).tobytes(), digest_size=16)
    h.update(own.encode())
    if adapter is not None:
        h.update(b"\0lora:" + adapter.encode())
    return h.digest()


@dataclass
class Request:
    """A row for the engine: its output row's base (row, id, carried input columns) and its key."""

    base: dict[str, Any]
    key: RequestKey


@dataclass
class ErrorRow:
    """A row finished without the engine (a bad row, a refused request): its output row, error set."""

    row: dict[str, Any]


@dataclass
class Answered:
    """A row answered without the engine: an earlier run's answer to the same request (output.reuse)."""

    row: dict[str, Any]


Made = Union[Request, ErrorRow, Answered]  # what a row makes
