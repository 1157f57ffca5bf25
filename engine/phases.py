"""A phase that can take seconds says when it starts and how long it took (shared by the packages below).

The lines go to ``dlrmflow.engine`` loggers, the engine's events: a flow sends them to its run's log
(``tasks.reporting.engine_events_to_run_log``), which the CLI shows on stderr, also with ``--json``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger("dlrmflow.engine.phases")


@contextmanager
def phase_reported(what: str) -> Iterator[None]:
    """Say that ``what`` starts, and once it ended, how long it took: a phase of seconds is never silent."""
    logger.info("%s ...", what)
    start = time.perf_counter()
    yield
    logger.info("%s: done in %.1f s", what, time.perf_counter() - start)
