"""Preloaded in every LocalCluster worker process (``preload=``): keeps Dask's heartbeat traceback out of the
terminal. A worker's heartbeat to a scheduler that is busy (it lives in the training process) or gone (the
cluster closing) fails with a logged traceback ("Failed to communicate with scheduler during heartbeat"),
which Dask retries by itself; every other line of the worker's log is kept."""

from __future__ import annotations

import logging

HEARTBEAT_FAILURE = "Failed to communicate with scheduler during heartbeat"


class _NoHeartbeatTraceback(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(HEARTBEAT_FAILURE)


def dask_setup(worker: object = None) -> None:
    """Dask's preload hook: the filter on the worker's logger (once per process)."""
    logger = logging.getLogger("distributed.worker")
    if not any(isinstance(f, _NoHeartbeatTraceback) for f in logger.filters):
        logger.addFilter(_NoHeartbeatTraceback())
