"""Prefect tasks of the recover-shard subflow (reporting only; the rebuild is in the engine)."""

from __future__ import annotations

from typing import Any

from dlrmflow.engine.coding.record import recovery_figures
from dlrmflow.tasks import task
from dlrmflow.tasks.reporting import artifact_key, metric_table, publish_table


def recovery_table(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per figure of the record (:func:`~dlrmflow.engine.coding.record.recovery_figures`: the figures
    the run's log and the train summary show too), one per new worker and one per loss, saying what noticed it."""
    return metric_table(recovery_figures(result))


@task(name="publish-recovery")
def publish_recovery_task(result: dict[str, Any], run: str = "") -> str:
    return publish_table(artifact_key("shard-recovery", run), recovery_table(result),
                         f"Recovery of {', '.join(result['lost'])}: "
                         f"{'rebuilt' if result.get('seconds') is not None else 'not finished'}")
