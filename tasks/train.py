"""Prefect tasks of the train flow (thin wrappers over :mod:`dlrmflow.engine.trainer`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from dlrmflow.engine.cluster import dask_client
from dlrmflow.engine.train_config import TrainConfig
from dlrmflow.engine.trainer import RunSetup, prepare_run, train
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


# A RunSetup holds the plan and the dataset's stream: hashing it for a cache key would cost a pass
# over the plan, and a training run is never a cache hit.
@task(name="check-train-config", cache_policy=NO_CACHE)
def check_task(config: TrainConfig) -> RunSetup:
    """Every input check before any work (dataset, plan, capacity, iterations, the run dir's checkpoint)."""
    return prepare_run(config)


@task(name="train-dlrm", cache_policy=NO_CACHE)
def train_task(setup: RunSetup, dask_address: str | None, recovery_runner: Callable | None = None) -> dict[str, Any]:
    """Train the checked run ``setup``; with parity, ``recovery_runner`` reports each shard rebuild."""
    config = setup.config
    logger = get_run_logger()
    progress = FlowProgress(f"{config.mode} training iterations")

    def on_metrics(row: dict[str, Any]) -> None:
        logger.info("iteration %d: loss %.4f, %.2f ms/iteration, stall %.2f ms",
                    row["iteration"], row["loss"], row["iteration_ms"], row["stall_ms"])

    if config.mode == "local":
        return train(config, setup=setup, progress=progress, on_metrics=on_metrics)
    with dask_client(dask_address) as client:
        return train(config, setup=setup, client=client, progress=progress, on_metrics=on_metrics,
                     recovery_runner=recovery_runner)


@task(name="publish-train-metrics")
def publish_metrics_task(summary: dict[str, Any]) -> None:
    publish_table("train-metrics", summary["metrics"],
                  f"{summary['mode']} training: loss and time every {summary['metrics_every']} iterations")
    rows = [{"metric": label, "value": summary.get(key)} for label, key in SUMMARY_ROWS]
    if summary.get("parity"):
        rows += [{"metric": label, "value": str(summary["parity"].get(key))} for label, key in PARITY_ROWS]
    publish_table("train-summary", rows, f"{summary['mode']} training run summary")
