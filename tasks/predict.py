"""Prefect tasks of the predict flow (thin wrappers over :mod:`dlrmflow.engine.training.prediction`)."""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger

from dlrmflow.tasks import task
from dlrmflow.tasks.evaluate import model_label
from dlrmflow.tasks.reporting import (
    PHASES_LOGGER,
    artifact_key,
    dataset_label,
    engine_events_to_run_log,
    metric_table,
    publish_table,
    run_dir_label,
)


@task(name="predict")
def predict_task(run_dir: str, inputs: list[str], output: str, batch_size: int = 4096, device: str = "cpu",
                 dask_address: str | None = None, score_on: str = "auto", held_out: bool = False) -> dict[str, Any]:
    """``run_dir``'s final model scored on ``inputs`` into ``output``: on the Dask cluster at ``dask_address``
    (else a LocalCluster) or in this process, as ``score_on`` says for the rows to score
    (:func:`~dlrmflow.engine.training.scoring.scores_on_cluster`)."""
    from contextlib import nullcontext

    from dlrmflow.engine.serving.cluster import dask_client
    from dlrmflow.engine.training.prediction import predict_run
    from dlrmflow.engine.training.scoring import scores_on_cluster

    def client_for(rows: int):
        return dask_client(dask_address) if scores_on_cluster(score_on, rows, dask_address) else nullcontext(None)

    logger = get_run_logger()
    # The scoring's progress and phases in this task's log, which the CLI shows on stderr
    with engine_events_to_run_log(logger), engine_events_to_run_log(logger, name=PHASES_LOGGER):
        result = predict_run(run_dir, inputs, output, batch_size=batch_size, device=device, held_out=held_out,
                             client_for=client_for)
    logger.info("%s scored %s rows of %s into %s at %s rows/s in %s", model_label(run_dir), f"{result['rows']:,}",
                inputs_label(inputs), output, f"{result['rows_per_second'] or 0:,}",
                "parts on the Dask cluster" if result["scored_on"] == "cluster" else "this process")
    return result


def inputs_label(inputs: list[str]) -> str:
    """What names a prediction's inputs: the first one's name, and how many more."""
    first = dataset_label(inputs[0]) if inputs else "nothing"
    return first if len(inputs) <= 1 else f"{first}-and-{len(inputs) - 1}-more"


@task(name="publish-prediction")
def publish_prediction_task(result: dict[str, Any]) -> str:
    """The prediction's summary as a table artifact, keyed by the run and the inputs."""
    key = artifact_key("predict", run_dir_label(result["run_dir"]), "on", inputs_label(result["inputs"]))
    table = metric_table([("rows", result["rows"], "count"), ("rows/s", result["rows_per_second"], "count"),
                          ("AUC", result["auc"], ""), ("log loss", result["log_loss"], ""),
                          ("click rate", result["positive_rate"], "%"),
                          ("ids new to the model", result["new_ids"], "count"),
                          ("lookups of new ids", result["new_id_lookup_share"], "%"),
                          ("rejected input rows", result["rejected_rows"], "count")])
    return publish_table(key, table, f"{result['run_dir']} predictions on {', '.join(result['inputs'])} in "
                                     f"{result['output']}")
