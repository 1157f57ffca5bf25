"""Prefect tasks of the recover-shard subflow (reporting only; the rebuild is in the engine)."""

from __future__ import annotations

from typing import Any

from prefect import task

from dlrmflow.tasks.reporting import publish_table


@task(name="publish-recovery")
def publish_recovery_task(result: dict[str, Any]) -> None:
    rows = [{"metric": k, "value": str(v)} for k, v in result.items()]
    publish_table("shard-recovery", rows, f"recovery of {', '.join(result['lost'])}")
