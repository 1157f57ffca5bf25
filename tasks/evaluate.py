"""Prefect tasks of the evaluate flow (thin wrappers over :mod:`dlrmflow.engine.training.scoring`)."""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task

from dlrmflow.tasks.reporting import (
    artifact_key,
    dataset_label,
    engine_events_to_run_log,
    metric_table,
    publish_table,
    run_dir_label,
)


@task(name="evaluate")
def evaluate_task(run_dir: str, dataset_dir: str, batch_size: int = 4096, device: str = "cpu") -> dict[str, Any]:
    """AUC, log loss and the constant-prediction log loss of ``run_dir``'s final model on ``dataset_dir``."""
    from dlrmflow.engine.training.scoring import evaluate_run

    logger = get_run_logger()
    with engine_events_to_run_log(logger):  # the scoring pass's progress ("evaluation rows: ...")
        result = evaluate_run(run_dir, dataset_dir, batch_size=batch_size, device=device)
    logger.info("%s on %s: AUC %s, log loss %s (constant prediction %s), %s rows", dataset_label(run_dir),
                dataset_label(dataset_dir), _fixed(result["auc"]), _fixed(result["log_loss"]),
                _fixed(result["constant_log_loss"]), f"{result['rows']:,}")
    return result


def _fixed(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"


@task(name="publish-evaluation")
def publish_evaluation_task(result: dict[str, Any]) -> str:
    """The evaluation as a table artifact, keyed by the run and the dataset."""
    key = artifact_key("evaluate", run_dir_label(result["run_dir"]), "on", dataset_label(result["dataset"]))
    table = metric_table([("rows", result["rows"], "count"), ("AUC", result["auc"], ""),
                          ("log loss", result["log_loss"], ""),
                          ("constant-prediction log loss", result["constant_log_loss"], ""),
                          ("click rate", result["positive_rate"], "%"),
                          ("ids new to the model", result["new_ids"], "count"),
                          ("lookups of new ids", result["new_id_lookup_share"], "%")])
    return publish_table(key, table, f"{result['run_dir']} evaluated on {result['dataset']}")
