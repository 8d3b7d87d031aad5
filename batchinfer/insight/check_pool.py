"""check_rows over chunks of rows in spawned worker processes, merged in row order: the same
result as one process."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional

from batchinfer.config.schema import Config
from batchinfer.errors import BatchinferError
from batchinfer.insight.findings import Checked
from batchinfer.insight.row_check import check_rows

log = logging.getLogger("batchinfer")

# One worker process's own tokenizer and memory-mapped dataset, loaded once by _start_worker.
_WORKER: dict[str, Any] = {}


def _start_worker(c: Config, dest: str, folder: str, max_len: int) -> None:
    import signal

    from batchinfer.inputs.convert import open_input
    from batchinfer.models.tokens import LoginTokenizer

    # Ctrl-C reaches the whole process group: the parent stops the pool, workers must not print tracebacks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:  # die with the parent (killed validate), rather than linger holding the dataset's memory map
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux
        pass
    _WORKER.update(c=c, ds=open_input(Path(dest)), tok=LoginTokenizer.from_model_dir(folder), max_len=max_len)


def _check_chunk(rows: Sequence[int]) -> tuple[int, Checked]:
    w = _WORKER
    return os.getpid(), check_rows(w["c"], w["ds"], w["tok"], w["max_len"], rows)


def check_parallel(
    c: Config,
    dest: Path,
    folder: Path,
    max_len: int,
    rows: Sequence[int],
    jobs: int,
    chunk_rows: int,
    progress: Optional[Callable[[int], Any]] = None,
) -> Checked:
    """check_rows over chunks of rows in `jobs` worker processes, merged in row order: the same result
    as one process. Spawned, not forked: the parent already runs pyarrow's and the tokenizer's threads,
    and a fork copies their locks in whatever state they are (deadlocks; tokenizers then turns its
    parallelism off with a warning); spawn costs each worker ~1 s of imports, once per run. A script
    calling this needs the `if __name__ == "__main__":` guard: spawn imports the main module."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from concurrent.futures.process import BrokenProcessPool

    chunks = [rows[i : i + chunk_rows] for i in range(0, len(rows), chunk_rows)]
    merged, pending, nxt, pids = Checked(), {}, 0, set()
    ctx = multiprocessing.get_context("spawn")
    init = (c, str(dest), str(folder), max_len)
    with ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_start_worker, initargs=init) as pool:
        try:
            futures = {pool.submit(_check_chunk, chunk): k for k, chunk in enumerate(chunks)}
            for future in as_completed(futures):
                try:
                    pid, pending[futures[future]] = future.result()
                except BrokenProcessPool:
                    raise BatchinferError(
                        f"validate: a worker process died (out of memory?); try fewer processes than --jobs {jobs}"
                    ) from None
                pids.add(pid)
                while nxt in pending:  # merged in row order as soon as the earlier chunks are in
                    merged.merge(pending.pop(nxt))
                    nxt += 1
                if progress is not None:
                    progress(len(chunks[futures[future]]))
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)  # workers finish their chunk (seconds), start no other
            raise
    log.debug("validate: %d chunks of %d rows checked by worker processes %s", len(chunks), chunk_rows, sorted(pids))
    return merged
