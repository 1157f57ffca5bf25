"""Prefect tasks of the export flow (thin wrappers over :mod:`dlrmflow.engine.training.model_export`)."""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger

from dlrmflow.tasks import task
from dlrmflow.tasks.reporting import artifact_key, metric_table, publish_table, run_dir_label


@task(name="export")
def export_task(run_dir: str, output: str, to: str = "torchrec") -> dict[str, Any]:
    """The finished run ``run_dir``'s model written into ``output`` for ``to`` (docs/export.md)."""
    from dlrmflow.engine.training.model_export import export_run

    result = export_run(run_dir, output, to=to)
    get_run_logger().info("%s model of %s exported to %s as a %s: %s tables, %s embedding rows, %s files "
                          "(%.1f MiB) in %.1f s", result["model"], run_dir, result["output"], result["format"],
                          result["tables"], f"{result['embedding_rows']:,}", len(result["files"]),
                          result["bytes"] / 2**20, result["seconds"])
    return result


@task(name="publish-export")
def publish_export_task(result: dict[str, Any]) -> str:
    """The export as a table artifact, keyed by the run directory and the target."""
    key = artifact_key("export", run_dir_label(result["run_dir"]), result["to"])
    table = metric_table([("model", result["model"], ""), ("format", result["format"], ""),
                          ("output", result["output"], ""), ("tables", result["tables"], "count"),
                          ("embedding rows", result["embedding_rows"], "count"),
                          ("embedding dim", result["embedding_dim"], "count"),
                          ("vocabulary", "included" if result["vocabulary"] else "none (ids as the dataset's)", ""),
                          ("size", result["bytes"], "MB"), ("time", result["seconds"], "s")])
    return publish_table(key, table, f"{result['run_dir']} exported to {result['output']}")
