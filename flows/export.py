"""The export flow: a finished run's model written for TorchRec (docs/export.md)."""

from __future__ import annotations

from typing import Any

from dlrmflow.flows.prefect_internals import flow
from dlrmflow.flows.run_names import export_run_name
from dlrmflow.tasks.export import export_task, publish_export_task


@flow(name="export", flow_run_name=export_run_name)
def export_flow(run_dir: str, output: str, to: str = "torchrec") -> dict[str, Any]:
    """``run_dir``'s final model written into ``output`` for ``to``: TorchRec's DLRM state dict for a DLRM, a
    ``torch.export`` program for the other models; the vocabulary of its dataset beside it."""
    result = export_task(run_dir, output, to)
    publish_export_task(result)
    return result
