"""The recover-shard subflow: one flow run per shard recovery, started by the train flow.

The engine rebuilds lost shards in a background thread of the trainer
(:mod:`dlrmflow.engine.recovery`); the train task hands it :func:`run_recovery_subflow` as its
``recovery_runner``, so each rebuild is its own Prefect flow run (a child of the training run)
with its logs, duration, progress artifact and a table of what was rebuilt.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

from prefect import flow, get_run_logger
from prefect.context import TaskRunContext

from dlrmflow.tasks.recovery import publish_recovery_task

# Flow parameters must be JSON: the rebuild itself (a closure over the live shard group) is
# handed over through this registry, keyed by an id that is a parameter.
_REBUILDS: dict[str, Callable[..., dict[str, Any]]] = {}
_LOCK = threading.Lock()
_IDS = itertools.count(1)


@flow(name="recover-shard")
def recover_shard_flow(recovery_id: str, lost: list[str], stripes: int, chunk: int) -> dict[str, Any]:
    """Rebuild the lost embedding shards from survivors + parity, chunk by chunk, while training runs."""
    from dlrmflow.tasks.reporting import FlowProgress

    logger = get_run_logger()
    with _LOCK:
        rebuild = _REBUILDS.pop(recovery_id)
    logger.info("lost %s: rebuilding %d stripes in chunks of %d on fresh workers", ", ".join(lost), stripes,
                chunk)
    start = time.perf_counter()
    result = rebuild(FlowProgress(f"rebuild of {', '.join(lost)} (stripes)", min_interval_s=0.5))
    logger.info("rebuilt %s: %d rows in %d chunks, %.3f s after detection (%d restarts)", ", ".join(result["lost"]),
                result["rows_rebuilt"], result["chunks"], result["seconds"] or time.perf_counter() - start,
                result["restarts"])
    publish_recovery_task(result)
    return result


def run_recovery_subflow(rebuild: Callable[..., dict[str, Any]], info: dict[str, Any]) -> dict[str, Any]:
    """The trainer's ``recovery_runner``: run ``rebuild`` inside a recover-shard flow run."""
    recovery_id = f"recovery-{next(_IDS)}"
    with _LOCK:
        _REBUILDS[recovery_id] = rebuild
    # The rebuild thread runs in a copy of the train task's context; without the task run in it,
    # the subflow's logs and artifacts belong to the subflow run (a child of the train flow run).
    token = TaskRunContext.__var__.set(None)
    try:
        return recover_shard_flow(recovery_id, info["lost"], info["stripes"], info["chunk"])
    finally:
        TaskRunContext.__var__.reset(token)
        with _LOCK:
            _REBUILDS.pop(recovery_id, None)


@flow(name="verify-parity")
def verify_flow(run_dir: str) -> dict[str, Any]:
    """Re-encode a finished run's data shards and compare with the parity shards it saved."""
    from dlrmflow.engine.parity import verify_run_dir

    result = verify_run_dir(run_dir)
    status = "OK" if result["ok"] else f"MISMATCH {result['mismatched_stripes']}"
    get_run_logger().info("verify %s: %s", run_dir, status)
    return result
