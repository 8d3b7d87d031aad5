"""What a row becomes for the worker: a request for the engine (with the key that says which rows
share its result) or, for a bad row, its error row at once."""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Any, Optional, Union


class RequestKey:
    """A request's identity: rows whose keys are equal are computed once. Its hash and digest are
    taken once (a key is looked up several times on its way through the worker)."""

    __slots__ = ("ids", "own", "own_row", "adapter", "image", "pixels", "_hash", "_digest")

    def __init__(
        self,
        ids: tuple[int, ...],
        own: str,
        own_row: Optional[int] = None,
        adapter: Optional[str] = None,
        image: Optional[str] = None,
        pixels: Any = None,
    ):
        self.ids = ids  # prompt token ids
        # the row's own sampling (canonical JSON, "" when none), or a pooling request's extras
        self.own = own
        # None: identical requests share one result (greedy or seeded sampling, pooling); else the
        # row this request belongs to alone (random sampling: each row its own sample)
        self.own_row = own_row
        self.adapter = adapter  # the LoRA adapter (model.lora.adapters); None: the base model
        self.image = image  # the content digest of the row's image (prompt.image_column); None: no image
        self.pixels = pixels  # that image decoded, for the engine (not part of the identity)
        self._hash = hash((ids, own, own_row, adapter, image))
        self._digest: Optional[bytes] = None

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, RequestKey):
            return NotImplemented
        return (
            self._hash == other._hash
            and self.ids == other.ids
            and self.own == other.own
            and self.own_row == other.own_row
            and self.adapter == other.adapter
            and self.image == other.image
        )

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return (
            f"RequestKey(ids={self.ids!r}, own={self.own!r}, own_row={self.own_row!r}, adapter={self.adapter!r}, "
            f"image={self.image!r})"
        )

    @property
    def shared(self) -> bool:
        """Whether identical requests may take this one's result (within and across windows)."""
        return self.own_row is None

    def digest(self) -> bytes:
        """The request's identity in the result cache and crash records: token ids, own sampling,
        adapter, image digest."""
        if self._digest is None:
            self._digest = request_digest(self.ids, self.own, self.adapter, self.image)
        return self._digest


def request_digest(ids: Any, own: str, adapter: Optional[str] = None, image: Optional[str] = None) -> bytes:
    """A digest of prompt token ids (as native int64), a row's own sampling, its LoRA adapter
    (the base model's digest is as before adapters existed) and its image's content digest."""
    h = hashlib.blake2b(struct.pack(f"={len(ids)}q", *ids), digest_size=16)
    h.update(own.encode())
    if adapter is not None:
        h.update(b"\0lora:" + adapter.encode())
    if image is not None:  # the picture's bytes, not its path: one image under two paths is one request
        h.update(b"\0image:" + image.encode())
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
