"""The recover-shard subflow: one flow run per shard recovery, started by the train flow.

The engine rebuilds lost shards in a background thread of the trainer
(:mod:`dlrmflow.engine.coding.rebuild`). The train flow makes ``recovery_runner()`` (below) and
the train task hands it to the engine, so each rebuild is reported by its own Prefect flow run (a
child of the training run) with its logs, progress artifact and a table of what was rebuilt. The
rebuild starts at once and does not wait for that flow run to start (which can take longer than the
rebuild itself); the flow run waits for the rebuild and reports its record.

Why the runner carries its own context: Prefect makes a flow called inside another flow run its
child only when it finds that parent's ``FlowRunContext`` in the calling thread's context
(``FlowRunEngine.create_flow_run``); with none it creates a top-level run. The loss is noticed by
whichever thread talks to the shards: the train task's own thread in ``remote`` mode, but the
prefetch worker's plain ``threading.Thread`` in ``oracle`` mode, whose context is empty, and the
recovery thread copies *that* (in process and under a Prefect worker alike). So the runner
captures the train task's context when it is made and runs every rebuild in a copy of it,
whichever thread calls it (:func:`~dlrmflow.flows.prefect_internals.capture_run_context`).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

from prefect import get_run_logger
from prefect.states import Cancelled

from dlrmflow.engine.coding.rebuild_state import GroupClosedError
from dlrmflow.engine.coding.record import rebuild_start_sentence, recovery_sentence
from dlrmflow.flows.prefect_internals import capture_run_context, flow, outside_task_run
from dlrmflow.flows.run_names import recover_run_name, recover_tags, tag_this_run, verify_run_name
from dlrmflow.tasks.recovery import publish_recovery_task

# Flow parameters must be JSON: the rebuild itself (a closure over the live shard group) is
# handed over through this registry, keyed by an id that is a parameter.
_REBUILDS: dict[str, Callable[..., dict[str, Any]]] = {}
_LOCK = threading.Lock()
_IDS = itertools.count(1)


@flow(name="recover-shard", flow_run_name=recover_run_name)
def recover_shard_flow(recovery_id: str, lost: list[str], stripes: int, chunk: int, run: str = "") -> dict[str, Any]:
    """Rebuild the lost embedding shards from survivors + parity, chunk by chunk, while training runs.

    ``run`` names the training run in the run's name and its report's artifact key (``shard-recovery-<run>``);
    the run is tagged ``recovery`` and ``lost:<member>``."""
    from dlrmflow.tasks.reporting import FlowProgress

    logger = get_run_logger()
    tag_this_run(recover_tags(lost))
    with _LOCK:
        rebuild = _REBUILDS.pop(recovery_id)
    logger.info("%s", report_timing(rebuild, ", ".join(lost), stripes, chunk))
    progress = FlowProgress(f"rebuild of {', '.join(lost)}: stripes copied from the survivors", min_interval_s=0.5)
    try:
        result = rebuild(progress)
    except GroupClosedError:  # the training run stopped first, for its own reason (which its run reports)
        return Cancelled(message=f"the training run stopped before the rebuild of {', '.join(lost)} ended")
    logger.info("%s", recovery_sentence(result))
    logger.info("bulk copy %.3f s: %.3f s in the copy tasks on the new shards' worker (%.3f s waiting for the "
                "survivors, %.3f s decoding and installing)", result["copy_seconds"], result["copy_task_seconds"],
                result["copy_read_wait_seconds"], result["copy_install_seconds"])
    progress.finish()
    publish_recovery_task(result, run)
    return result


def report_timing(rebuild: Callable[..., dict[str, Any]], lost: str, stripes: int, chunk: int) -> str:
    """Whose time this flow run's is: the rebuild started when the loss was noticed, before this run (a flow
    run takes a while to start), and may have ended already; the run waits for it and reports it."""
    started_at = getattr(rebuild, "started_at", None)
    if started_at is None:
        return rebuild_start_sentence([lost], stripes, chunk)
    ended = getattr(rebuild, "finished", lambda: False)()
    return (f"the rebuild of {lost} ({stripes:,} stripes) started {time.perf_counter() - started_at:.3f} s before "
            f"this flow run, as soon as the loss was noticed, and {'had already ended' if ended else 'is running'}: "
            f"this run reports it, so its own duration is not the rebuild's ('Rebuilt after detection' is)")


Runner = Callable[[Callable[..., dict[str, Any]], dict[str, Any]], dict[str, Any]]


def recovery_runner(run: str = "") -> Runner:
    """The trainer's ``recovery_runner``, made by the train flow: every recover-shard run it starts
    is a child of the calling flow run, whichever thread (prefetch worker, recovery thread) calls it.
    ``run`` names the training run in the reports' artifact keys."""
    in_train_context = capture_run_context()
    # Prefect links a subflow's result and the values in it to the subflow run by their ``id()``
    # in the train flow run's context (``link_state_to_result``), and never forgets them. The engine
    # keeps only a copy, so once these dicts and lists were freed a new list of the flow (the report
    # task's ``wait_for``) could reuse an address and be taken for the subflow's result: a
    # ``flow_run`` input, which the UI's task run pages reject. Held here, as long as the train task
    # holds the runner, no object of the flow can share their ids.
    results: list[Any] = []

    def run_in_train_context(rebuild: Callable[..., dict[str, Any]], info: dict[str, Any]) -> dict[str, Any]:
        result = in_train_context(run_recovery_subflow, rebuild, {**info, "run": run})
        results.append((result, *result.values()))
        return result

    return run_in_train_context


def run_recovery_subflow(rebuild: Callable[..., dict[str, Any]], info: dict[str, Any]) -> dict[str, Any]:
    """Run ``rebuild`` inside a recover-shard flow run: a child of the flow run in the calling thread's
    context, if any (see :func:`recovery_runner` for a runner that brings that context along)."""
    recovery_id = f"recovery-{next(_IDS)}"
    with _LOCK:
        _REBUILDS[recovery_id] = rebuild
    try:
        # The context is the train task's; without the task run in it, the subflow's logs and artifacts
        # belong to the subflow run (a child of the train flow run), not to the train task.
        with outside_task_run():
            return recover_shard_flow(recovery_id, info["lost"], info["stripes"], info["chunk"], info.get("run", ""))
    finally:
        with _LOCK:
            _REBUILDS.pop(recovery_id, None)


@flow(name="verify-parity", flow_run_name=verify_run_name)
def verify_flow(run_dir: str) -> dict[str, Any]:
    """Re-encode a finished run's data shards and compare with the parity shards it saved."""
    from dlrmflow.engine.coding.verify import verify_run_dir
    from dlrmflow.tasks.reporting import FlowProgress

    progress = FlowProgress("verify stripes")  # on stderr with --json too: a long pass is never silent
    result = verify_run_dir(run_dir, progress=progress)
    progress.finish()
    status = "OK" if result["ok"] else f"MISMATCH {result['mismatched_stripes']}"
    get_run_logger().info("verify %s: %s", run_dir, status)
    return result
