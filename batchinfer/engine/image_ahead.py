"""vLLM's image processor run ahead of the engine's add (prompt.image_column rows): the requests next
in line to be sent have their images processed (resized, normalized into the model's pixel tensors,
the image token expanded: `renderer.render_cmpl`) on one thread of their own, so the main thread,
which steps the engine, only hands the processed request over. One thread does all the processing,
in the order requests are sent, as vLLM's own renderer keeps its processor to one worker.

At most `depth` requests are processed and not yet sent, their tensors held in the image window
(cluster.image_window_mb) beside the decoded images: a request is processed ahead only while the
last one's tensors would fit; the others are processed when they are sent."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

from batchinfer.requests.image_budget import ImageBudget
from batchinfer.requests.request import RequestKey


class Processed:
    """A request's image through vLLM's processor: the input its engine's add_request takes."""

    __slots__ = ("digest", "engine_input", "nbytes", "__weakref__")

    def __init__(self, digest: str, engine_input: Any, nbytes: int = 0):
        self.digest = digest  # the image's content digest (its media uuid in vLLM)
        self.engine_input = engine_input
        self.nbytes = nbytes  # the bytes of its tensors


class ImageAhead:
    """Processing of the images of the next requests to send, on one thread (see the module)."""

    def __init__(self, engine: Any, depth: int, budget: Optional[ImageBudget] = None):
        self.engine = engine  # has process_image(token_ids, (digest, pixels)) -> Processed
        self.depth = max(depth, 1)
        self.budget = budget  # the image window the processed tensors are held in
        self.started_ahead = 0  # requests whose processing started before they were sent
        self._last = 0  # the bytes of the last request's tensors: what the next is expected to take
        self._pool = ThreadPoolExecutor(1, "batchinfer-images")
        self._jobs: dict[RequestKey, Future[Processed]] = {}

    @classmethod
    def of(cls, engine: Any, depth: int, budget: Optional[ImageBudget] = None) -> Optional[ImageAhead]:
        """One for an engine that can process images apart from add (vLLM's); None otherwise (the
        stand-ins: their add takes the decoded image)."""
        return cls(engine, depth, budget) if callable(getattr(engine, "process_image", None)) else None

    def ahead(self, keys: Iterable[RequestKey]) -> None:
        """Start processing the images of these requests (the next to send, in order), keeping at
        most `depth` processed or being processed."""
        for key in keys:
            if len(self._jobs) >= self.depth:
                return
            if key.image is not None and key.pixels is not None and key not in self._jobs:
                if self.budget is not None and not self.budget.admits(self._last):
                    return  # no room for its tensors: processed when it is sent
                self._jobs[key] = self._start(key)
                self.started_ahead += 1

    def take(self, key: RequestKey) -> Processed:
        """The request's processed image (processed now, on the same thread, if it was not started);
        raises what processing raised (the request's refusal)."""
        job = self._jobs.pop(key, None) or self._start(key)
        return job.result()

    def _start(self, key: RequestKey) -> Future[Processed]:
        return self._pool.submit(self._process, list(key.ids), (key.image, key.pixels))

    def _process(self, ids: list[int], image: tuple[str, Any]) -> Processed:
        """On the image thread: the processing, its tensors held in the image window."""
        done = self.engine.process_image(ids, image)
        self._last = done.nbytes
        if self.budget is not None:
            self.budget.hold(done, done.nbytes)
        return done

    def close(self) -> None:
        """Drop what is not started and wait for the one processing."""
        for job in self._jobs.values():
            job.cancel()
        self._jobs.clear()
        self._pool.shutdown(wait=True)


def tensor_bytes(value: Any) -> int:
    """The bytes of the tensors in vLLM's processed multimodal inputs (mappings, sequences and
    fields' `.data` down to tensors)."""
    if hasattr(value, "nbytes") and hasattr(value, "dtype"):  # a torch tensor or numpy array
        return int(value.nbytes)
    if isinstance(value, Mapping):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    if hasattr(value, "data") and not isinstance(value, (bytes, str)):  # MultiModalFieldElem
        return tensor_bytes(value.data)
    return 0
