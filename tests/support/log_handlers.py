"""The batchinfer logger's handlers kept apart per test: `main()` and the Slurm entry points run
setup_logging, which binds a handler to the running test's captured stderr."""

from __future__ import annotations

import logging
from collections.abc import Iterator


def restored_log_handlers(propagate: bool = False, clear: bool = True) -> Iterator[None]:
    """Clear the batchinfer logger's handlers for a test (unless clear=False) and restore them
    after (a fixture's body: `yield from restored_log_handlers()`); propagate=True lets caplog, at
    the root, hear it."""
    logger = logging.getLogger("batchinfer")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    if clear:
        logger.handlers.clear()
    if propagate:
        logger.propagate = True  # an earlier module's setup_logging turned it off
    yield
    logger.handlers[:], logger.level, logger.propagate = saved
