"""Where a training command's wall time goes outside its iterations: start-up and finish.

``startup_seconds``: from the command's launch (``DLRMFLOW_LAUNCHED_AT``, seconds since the epoch, which
``dlrmflow`` sets; absent when the engine is called directly) to the start of the first iteration.
``finish_seconds``: from the end of the last iteration to summary.json, with its phases (``finish``):
the store's flush, the final evaluation, collecting the state, the parity verify, writing the files.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

LAUNCHED_AT_ENV = "DLRMFLOW_LAUNCHED_AT"


def launched_at() -> float | None:
    """The command's launch time, if a command set it."""
    try:
        return float(os.environ[LAUNCHED_AT_ENV])
    except (KeyError, ValueError):
        return None


@contextmanager
def timed(phases: dict[str, float], phase: str) -> Iterator[None]:
    """Add the block's wall seconds to ``phases[phase]``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        phases[phase] = phases.get(phase, 0.0) + time.perf_counter() - start


def run_timing(lead: dict[str, Any]) -> dict[str, Any]:
    """The summary's timing fields from trainer 0's outcome (``began_at``, ``ended_at`` and its ``finish``
    phases), measured now, just before summary.json is written. ``finish["write"]`` is what the phases
    leave: the state's hash and file, iterations.csv, the trainers' results coming home."""
    launched = launched_at()
    total = time.time() - lead["ended_at"]
    finish = {"flush": lead["log"]["flush_seconds"], **lead["finish"]}
    finish["write"] = max(0.0, total - sum(finish.values()))
    return {"startup_seconds": None if launched is None else round(max(0.0, lead["began_at"] - launched), 6),
            "finish_seconds": round(total, 6),
            "finish": {phase: round(seconds, 6) for phase, seconds in finish.items()}}
