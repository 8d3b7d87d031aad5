"""The worker's side of request digests and output.reuse: each request's digest goes into its output
row; a request an output.reuse directory answered becomes that answer at once, never reaching the engine."""

from __future__ import annotations

from typing import Optional

from batchinfer.errors import ConfigError
from batchinfer.requests.digest import RequestDigests
from batchinfer.requests.request import Answered, Made, Request, RequestKey
from batchinfer.rundir.model_record import identity_digest
from batchinfer.rundir.reuse import ReuseIndex, reuse_paths
from batchinfer.rundir.schema import DIGEST_COLUMN, REUSED_COLUMN, OutputRow
from batchinfer.rundir.store import RunDir


class RowReuse:
    """Digests of one run's requests, and the answers of its output.reuse directories (indexed once,
    at the first request: a worker runs all the shards of its task)."""

    def __init__(self, run: RunDir):
        self.run = run
        self.recorded = DIGEST_COLUMN in run.schema.names  # run directories made before record none
        self.paths = reuse_paths(run.config.output.reuse)
        self.identity = identity_digest(run.run)  # the model's files, as recorded at prepare
        if self.paths and not self.recorded:
            raise ConfigError(
                f"output.reuse: {run.path} was made by an earlier batchinfer without request digests; "
                "reusing answers needs a new run directory (another output.dir)"
            )
        self._digests: Optional[RequestDigests] = None
        self._digests_dtype: Optional[str] = None
        self._index: Optional[ReuseIndex] = None
        self.hits = 0  # rows answered from output.reuse by this worker

    def made(self, base: OutputRow, key: RequestKey, dtype: str) -> Made:
        """The row's request with its digest in its output base, or the earlier answer to it."""
        if not self.recorded:
            return Request(base, key)
        if self._digests is None or self._digests_dtype != dtype:
            self._digests, self._digests_dtype = (
                RequestDigests(self.run.run["fingerprint_keys"], dtype, self.identity),
                dtype,
            )
        digest = self._digests.of(key, base["id"])
        base.update({DIGEST_COLUMN: digest, REUSED_COLUMN: False})
        answer = self.index.answer(digest) if self.paths else None
        if answer is None:
            return Request(base, key)
        self.hits += 1
        return Answered({**answer, **base, REUSED_COLUMN: True})

    @property
    def index(self) -> ReuseIndex:
        """The output.reuse directories' answers, indexed at the first look-up."""
        if self._index is None:
            self._index = ReuseIndex(self.paths, self.run.schema.names, self.identity)
        return self._index
