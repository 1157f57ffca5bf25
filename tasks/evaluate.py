"""Prefect tasks of the evaluate flow (thin wrappers over :mod:`dlrmflow.engine.training.scoring`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import get_run_logger

from dlrmflow.tasks import task
from dlrmflow.tasks.reporting import (
    PHASES_LOGGER,
    artifact_key,
    dataset_label,
    engine_events_to_run_log,
    metric_table,
    publish_table,
    run_dir_label,
)


@task(name="evaluate")
def evaluate_task(run_dir: str, dataset_dir: str, batch_size: int = 4096, device: str = "cpu",
                  dask_address: str | None = None, score_on: str = "auto") -> dict[str, Any]:
    """AUC, log loss and the constant-prediction log loss of ``run_dir``'s final model on ``dataset_dir``: on the
    Dask cluster at ``dask_address`` (else a LocalCluster) or in this process, as ``score_on`` says
    (:func:`~dlrmflow.engine.training.scoring.scores_on_cluster`)."""
    from contextlib import nullcontext

    from dlrmflow.datasets.meta import read_meta
    from dlrmflow.engine.serving.cluster import dask_client
    from dlrmflow.engine.training.scoring import evaluate_run, scores_on_cluster

    logger = get_run_logger()
    on_cluster = scores_on_cluster(score_on, read_meta(dataset_dir).rows, dask_address)
    # The scoring's progress and phases in this task's log (inside the nightly run too, which sends its own there)
    with engine_events_to_run_log(logger), engine_events_to_run_log(logger, name=PHASES_LOGGER), \
            (dask_client(dask_address) if on_cluster else nullcontext(None)) as client:  # progress, dashboard
        result = evaluate_run(run_dir, dataset_dir, batch_size=batch_size, device=device, client=client)
    logger.info("%s on %s: AUC %s, log loss %s (constant prediction %s), %s rows scored in %s", model_label(run_dir),
                dataset_label(dataset_dir), _fixed(result["auc"]), _fixed(result["log_loss"]),
                _fixed(result["constant_log_loss"]), f"{result['rows']:,}",
                "parts on the Dask cluster" if result["scored_on"] == "cluster" else "this process")
    return result


def model_label(run_dir: str | Path) -> str:
    """Whose model a run directory holds, as a log line names it: ``day_1's model`` for the daily loop's
    ``STATE/days/day_1/run``, ``oracle's model`` for ``runs/oracle``."""
    path = Path(run_dir)
    name = path.name or path.resolve().name
    return f"{path.parent.name if name == 'run' and path.parent.name else name}'s model"


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
