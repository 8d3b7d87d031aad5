"""A request's digest: a hash of everything that decides its answer, kept per row in the parts'
`request_digest` column, by which output.reuse finds an earlier run's answer to the same request."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Optional

from batchinfer.config.fingerprint import answer_keys
from batchinfer.requests.request import RequestKey


class RequestDigests:
    """Digests of one run's requests on one engine: the run's answer keys (the fingerprint's rule,
    config.fingerprint.answer_keys) with the dtype the engine runs in, then each request's own part."""

    def __init__(self, fingerprint_keys: dict[str, Any], dtype: str, identity: Optional[str] = None):
        """identity: the model identity digest recorded at prepare (None: a run prepared before
        identities were recorded, whose digests stay as they were)."""
        # model.dtype `auto` becomes the hardware's choice: the dtype the engine runs in decides
        keys = dict(answer_keys(fingerprint_keys), **{"model.dtype": dtype})
        if identity is not None:  # the same path with other weights is another model
            keys["model.identity"] = identity
        blob = json.dumps(keys, sort_keys=True, default=str).encode()
        self.salt = hashlib.blake2b(blob, digest_size=16).digest()

    def of(self, key: RequestKey, row_id: Any) -> str:
        """The hex digest of a request: the run's answer keys, its prompt token ids and own sampling
        (or pooling extras); under unseeded random sampling also the row's id, since such a request's
        answer is that row's own sample (identical rows are sampled independently)."""
        h = hashlib.blake2b(self.salt, digest_size=16)
        h.update(key.digest())
        if not key.shared:
            h.update(b"\0row:" + repr(row_id).encode())
        return h.hexdigest()
