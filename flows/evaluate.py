"""The evaluate flow: a finished run's model scored on a dataset, without training (progressive validation)."""

from __future__ import annotations

from typing import Any

from dlrmflow.flows.prefect_internals import flow
from dlrmflow.flows.run_names import evaluate_run_name
from dlrmflow.tasks.evaluate import evaluate_task, publish_evaluation_task


@flow(name="evaluate", flow_run_name=evaluate_run_name)
def evaluate_flow(run_dir: str, dataset_dir: str, batch_size: int = 4096, device: str = "cpu",
                  dask_address: str | None = None, score_on: str = "auto") -> dict[str, Any]:
    """AUC, log loss and constant-prediction log loss of ``run_dir``'s final model on every row of ``dataset_dir``,
    scored a part per task on the Dask cluster at ``dask_address`` (else a LocalCluster) or in this process
    (``score_on``: auto, cluster or process; auto: the cluster for an address or at least 524,288 rows)."""
    result = evaluate_task(run_dir, dataset_dir, batch_size, device, dask_address, score_on)
    publish_evaluation_task(result)
    return result
