"""Prefect tasks of the train flow (thin wrappers over :mod:`dlrmflow.engine.trainer`)."""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task

from dlrmflow.engine.cluster import dask_client
from dlrmflow.engine.trainer import TrainConfig, prepare_run, train
from dlrmflow.tasks.reporting import FlowProgress, publish_table

SUMMARY_ROWS = [
    ("mode", "mode"), ("iterations", "iterations"), ("batch size", "batch_size"), ("shards", "num_shards"),
    ("cache rows", "capacity"), ("mean iteration (ms)", "mean_iteration_ms"), ("stall fraction", "stall_fraction"),
    ("bytes fetched", "bytes_fetched"), ("bytes written back", "bytes_written_back"),
    ("final train loss", "final_train_loss_mean"), ("eval AUC", "eval_auc"), ("eval log loss", "eval_log_loss"),
    ("state SHA-256", "state_sha256"),
]
PARITY_ROWS = [
    ("parity shards", "parity_shards"), ("write-back batches", "write_back_batches"),
    ("parity bytes sent", "parity_bytes_sent"), ("degraded rows read", "degraded_rows_read"),
    ("recoveries", "recoveries"), ("verify", "verify"),
]


@task(name="check-train-config")
def check_task(config: dict[str, Any]) -> dict[str, Any]:
    """Every input check before any work (dataset, plan, capacity, iterations, the run dir's checkpoint);
    the iteration count and, for a resume, the checkpoint's iteration."""
    setup = prepare_run(TrainConfig(**config))
    return {"iterations": setup.iterations, "resume_at": setup.resume_at}


@task(name="train-dlrm")
def train_task(config: dict[str, Any], dask_address: str | None) -> dict[str, Any]:
    config = TrainConfig(**config)
    logger = get_run_logger()
    progress = FlowProgress(f"{config.mode} training iterations")

    def on_metrics(row: dict[str, Any]) -> None:
        logger.info("iteration %d: loss %.4f, %.2f ms/iteration, stall %.2f ms",
                    row["iteration"], row["loss"], row["iteration_ms"], row["stall_ms"])

    if config.mode == "local":
        return train(config, progress=progress, on_metrics=on_metrics)
    runner = None
    if config.parity:
        from dlrmflow.flows.recovery import recovery_runner

        # Each rebuild is a recover-shard child of this train flow run, whatever thread notices the loss.
        runner = recovery_runner()
    with dask_client(dask_address) as client:
        return train(config, client=client, progress=progress, on_metrics=on_metrics, recovery_runner=runner)


@task(name="publish-train-metrics")
def publish_metrics_task(summary: dict[str, Any]) -> None:
    publish_table("train-metrics", summary["metrics"],
                  f"{summary['mode']} training: loss and time every {summary['metrics_every']} iterations")
    rows = [{"metric": label, "value": summary.get(key)} for label, key in SUMMARY_ROWS]
    if summary.get("parity"):
        rows += [{"metric": label, "value": str(summary["parity"].get(key))} for label, key in PARITY_ROWS]
    publish_table("train-summary", rows, f"{summary['mode']} training run summary")
