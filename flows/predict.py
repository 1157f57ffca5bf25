"""The predict flow: a finished run's model scores raw files or a dataset, its predictions written as Parquet."""

from __future__ import annotations

from typing import Any

from prefect.runtime import flow_run

from dlrmflow.flows.prefect_internals import flow
from dlrmflow.tasks.predict import inputs_label, predict_task, publish_prediction_task
from dlrmflow.tasks.reporting import artifact_key, run_dir_label


def predict_run_name() -> str:
    """``predict-<run dir label>-on-<first input>``."""
    params = flow_run.get_parameters() or {}
    return artifact_key("predict", run_dir_label(params.get("run_dir", "")), "on",
                        inputs_label(list(params.get("inputs") or [])))


@flow(name="predict", flow_run_name=predict_run_name)
def predict_flow(run_dir: str, inputs: list[str], output: str, batch_size: int = 4096, device: str = "cpu",
                 dask_address: str | None = None, score_on: str = "auto", held_out: bool = False) -> dict[str, Any]:
    """``run_dir``'s final model scored on ``inputs`` (raw files of its format, or one preprocessed dataset) into
    the new directory ``output``: Parquet parts of row, probability and label; rows/s, new ids, AUC and log loss.
    Scored a part per task on the Dask cluster at ``dask_address`` (else a LocalCluster) or in this process
    (``score_on``: auto, cluster or process; auto: the cluster for an address or at least 524,288 rows);
    ``held_out``: the run's own held-out rows only."""
    result = predict_task(run_dir, inputs, output, batch_size, device, dask_address, score_on, held_out)
    publish_prediction_task(result)
    return result
