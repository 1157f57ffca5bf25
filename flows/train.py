"""The train flow: check the configuration, train (with embedding servers unless local), report.

A run with ``checkpoint_every`` that fails or crashes leaves a checkpoint; the flow's hooks then
log the command that resumes it (``dlrmflow resume RUN_DIR``, or this flow with ``resume=True``)
in the flow run's logs.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from prefect import flow, get_run_logger
from prefect.logging.loggers import flow_run_logger

from dlrmflow.engine.checkpoint import unfinished_run_message
from dlrmflow.engine.cluster import dask_scheduler
from dlrmflow.engine.trainer import TrainConfig
from dlrmflow.tasks.train import check_task, publish_metrics_task, train_task


def log_resume_command(flow, flow_run, state) -> None:
    """on_failure / on_crashed: when the run dir holds an unfinished run with a checkpoint, say how to resume it."""
    try:
        message = unfinished_run_message(flow_run.parameters.get("output_dir"))
    except Exception as exc:  # a hook must not hide the failure it reports on
        message = f"the checkpoint cannot be read ({exc})"
    if message:
        flow_run_logger(flow_run, flow).error("%s", message)


@flow(name="train", on_failure=[log_resume_command], on_crashed=[log_resume_command])
def train_flow(
    dataset_dir: str,
    mode: str,
    output_dir: str,
    batch_size: int = 128,
    iterations: int | None = None,
    num_shards: int = 2,
    capacity: int | None = None,
    plan_dir: str | None = None,
    device: str = "cpu",
    seed: int = 0,
    embedding_dim: int = 16,
    bottom_mlp: list[int] | None = None,
    top_mlp: list[int] | None = None,
    embedding_optimizer: str = "adagrad",
    dense_optimizer: str = "sgd",
    lr: float = 0.01,
    embedding_lr: float | None = None,
    eval_fraction: float = 0.1,
    metrics_every: int = 50,
    parity: int = 0,
    kills: list[str] | None = None,
    rebuild_chunk: int = TrainConfig.rebuild_chunk,
    parity_batches: int = TrainConfig.parity_batches,
    rebuild_rate: float = TrainConfig.rebuild_rate,
    checkpoint_every: int | None = None,
    resume: bool = False,
    dask_address: str | None = None,
) -> dict[str, Any]:
    """Train a DLRM in ``mode`` (local | remote | lru | oracle); writes final_state.pt and summary.json.

    ``resume``: continue the unfinished run in ``output_dir`` from its checkpoint; every other parameter
    must be the run's own (``dlrmflow resume RUN_DIR`` reads them from its run_config.json)."""
    config = TrainConfig(
        dataset_dir=dataset_dir, mode=mode, output_dir=output_dir, batch_size=batch_size, iterations=iterations,
        num_shards=num_shards, capacity=capacity, plan_dir=plan_dir, device=device, seed=seed,
        embedding_dim=embedding_dim, bottom_mlp=tuple(bottom_mlp) if bottom_mlp else None,
        top_mlp=tuple(top_mlp) if top_mlp else TrainConfig.top_mlp, embedding_optimizer=embedding_optimizer,
        dense_optimizer=dense_optimizer, lr=lr, embedding_lr=embedding_lr, eval_fraction=eval_fraction,
        metrics_every=metrics_every, parity=parity, kills=tuple(kills or ()), rebuild_chunk=rebuild_chunk,
        parity_batches=parity_batches, rebuild_rate=rebuild_rate, checkpoint_every=checkpoint_every, resume=resume,
    )
    params = asdict(config)
    checked = check_task(params)
    n = checked["iterations"]
    logger = get_run_logger()
    logger.info("%s training: %d iterations of batch %d on %s", mode, n, batch_size, device)
    if resume:
        logger.info("resuming %s from its checkpoint at iteration %d", output_dir, checked["resume_at"])
    if mode == "local":
        summary = train_task(params, None)
    else:
        # With parity a LocalCluster gets one worker per shard (data and parity: separate fault
        # domains) plus a spare, so a rebuild starts at once on a fresh worker.
        workers = num_shards + parity + 1 if parity else None
        with dask_scheduler(dask_address, n_workers=workers) as address:
            logger.info("embedding servers: %d shards on the Dask cluster at %s", num_shards, address)
            summary = train_task(params, address)
    publish_metrics_task(summary)
    logger.info("done: %.2f ms/iteration, stall %.1f%%, eval AUC %s; state SHA-256 %s",
                summary["mean_iteration_ms"], 100 * summary["stall_fraction"], summary["eval_auc"],
                summary["state_sha256"][:16])
    return summary
