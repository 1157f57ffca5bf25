"""Prefect tasks of the recover-shard subflow (reporting only; the rebuild is in the engine)."""

from __future__ import annotations

import re
from typing import Any

from prefect import task

from dlrmflow.tasks.reporting import artifact_key, metric_table, publish_table

# (what, record key, unit) of the shard-recovery table.
RECORD_ITEMS = [
    ("Lost", "lost", ""), ("Detected after the shards started", "detected_s", "s"),
    ("Rebuilt after detection", "seconds", "s"), ("Found replacement workers", "placement_seconds", "s"),
    ("Stripes", "stripes", "count"), ("Rows copied", "rows_rebuilt", "count"), ("Chunks", "chunks", "count"),
    ("Stripes generated from the seed", "stripes_generated", "count"),
    ("Stripes fixed up", "stripes_fixed_up", "count"), ("Fix-ups", "fix_ups", "count"),
    ("Bulk copy", "copy_seconds", "s"), ("Copy tasks on the new worker", "copy_task_seconds", "s"),
    ("Waiting for survivors", "copy_read_wait_seconds", "s"),
    ("Decoding and installing", "copy_install_seconds", "s"),
    ("Training waited for fix-ups", "locked_seconds", "s"), ("Restarts", "restarts", "count"),
]


_EXCEPTION_REPR = re.compile(r"\b([A-Z]\w*(?:Error|Exception|Exit|Interrupt|Closed))\((?:(['\"])(.*?)\2)?\)")


def readable_error(text: str) -> str:
    """An error as a person reads it, not its Python repr: ``members [0] lost: OSError("Unable to contact
    Actor's worker")`` -> ``members [0] lost: OSError: Unable to contact Actor's worker``."""
    return _EXCEPTION_REPR.sub(lambda m: f"{m[1]}: {m[3]}" if m[3] else m[1], str(text))


def recovery_table(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per figure of the record, one per new worker and one per failure that showed the loss."""
    items = [(what, result.get(key), unit) for what, key, unit in RECORD_ITEMS]
    items += [(f"New worker of {member}", worker, "") for member, worker in result.get("new_workers", {}).items()]
    items += [(f"Noticed by ({n})", readable_error(cause), "")
              for n, cause in enumerate(result.get("causes", []), start=1)]
    return metric_table(items)


@task(name="publish-recovery")
def publish_recovery_task(result: dict[str, Any], run: str = "") -> str:
    return publish_table(artifact_key("shard-recovery", run), recovery_table(result),
                         f"Recovery of {', '.join(result['lost'])}")
