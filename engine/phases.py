"""A phase that can take seconds says when it starts and how long it took (shared by the packages below).

The lines go to ``dlrmflow.engine`` loggers, the engine's events: a flow sends them to its run's log
(``tasks.reporting.engine_events_to_run_log``), which the CLI shows on stderr, also with ``--json``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

ENGINE_LOGGER = "dlrmflow.engine"  # the engine's events: every engine module's logger is below it
logger = logging.getLogger("dlrmflow.engine.phases")


@contextmanager
def engine_events_to(handler: logging.Handler, name: str = ENGINE_LOGGER) -> Iterator[logging.Logger]:
    """Within the block, the events of the engine logger ``name`` at INFO and above also go to ``handler``
    (the logger's level is lowered to INFO for the block if it was higher, then restored). Yields the logger."""
    engine = logging.getLogger(name)
    level = engine.level
    engine.addHandler(handler)
    if engine.getEffectiveLevel() > logging.INFO:
        engine.setLevel(logging.INFO)
    try:
        yield engine
    finally:
        engine.removeHandler(handler)
        engine.setLevel(level)


def say(what: str) -> None:
    """A fact about the work in progress, where the phases are reported (e.g. where its dashboard is)."""
    logger.info("%s", what)


@contextmanager
def phase_reported(what: str) -> Iterator[None]:
    """Say that ``what`` starts, and once it ended, how long it took: a phase of seconds is never silent."""
    logger.info("%s ...", what)
    start = time.perf_counter()
    yield
    logger.info("%s: done in %.1f s", what, time.perf_counter() - start)


class PhaseProgress:
    """``what: done/total (p%)`` lines of a long phase, at most one per ``interval_s`` and always the last:
    a phase of minutes (the final evaluation of a Terabyte-sized held-out set) shows that it moves."""

    def __init__(self, what: str, total: int, interval_s: float = 5.0) -> None:
        self.what, self.total, self.interval_s = what, total, interval_s
        self._last = time.perf_counter()

    def __call__(self, done: int) -> None:
        now = time.perf_counter()
        if done < self.total and now - self._last < self.interval_s:
            return
        self._last = now
        percent = 100.0 * done / self.total if self.total else 100.0
        logger.info("%s: %d/%d (%.0f%%)", self.what, done, self.total, percent)
