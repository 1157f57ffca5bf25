"""Dataset flows: generate synthetic raw data, preprocess raw files, profile the access skew."""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger

from dlrmflow.datasets.preprocess import DEFAULT_BLOCK_BYTES
from dlrmflow.engine.serving.cluster import dask_scheduler
from dlrmflow.flows.run_names import generate_run_name, preprocess_run_name, profile_run_name
from dlrmflow.tasks.dataset import generate_task, preprocess_task, profile_task, publish_profile_task


@flow(name="generate", flow_run_name=generate_run_name)
def generate_flow(output: str, rows: int, seed: int = 0, scale: float = 1.0,
                  dask_address: str | None = None) -> dict[str, Any]:
    """Write a synthetic dataset in the raw Criteo TSV format."""
    with dask_scheduler(dask_address) as address:
        return generate_task(output, rows, seed, scale, address)


@flow(name="preprocess", flow_run_name=preprocess_run_name)
def preprocess_flow(
    inputs: list[str],
    output: str,
    format: str = "criteo",
    seed: int = 0,
    min_frequency: int = 1,
    max_rows_per_table: int | None = None,
    max_reject_fraction: float = 0.01,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    force: bool = False,
    dask_address: str | None = None,
) -> dict[str, Any]:
    """Raw files -> shuffled Parquet dataset with frequency-ordered ids (skips if up to date)."""
    options = dict(fmt=format, seed=seed, min_frequency=min_frequency, max_rows_per_table=max_rows_per_table,
                   max_reject_fraction=max_reject_fraction, block_bytes=block_bytes, force=force)
    with dask_scheduler(dask_address) as address:
        summary = preprocess_task(inputs, output, options, address)
    logger = get_run_logger()
    if summary["skipped"]:
        logger.info("%s is up to date (same inputs and parameters): nothing to do", output)
    if summary["rejected_rows"]:
        logger.warning("%d rows rejected (%s); see %s", summary["rejected_rows"],
                       summary["rejected_by_reason"], summary["rejected_file"])
    return summary


@flow(name="profile", flow_run_name=profile_run_name)
def profile_flow(dataset_dir: str, dask_address: str | None = None) -> dict[str, Any]:
    """Per-table access counts -> profile.json, coverage plot and a skew table artifact."""
    with dask_scheduler(dask_address) as address:
        profile = profile_task(dataset_dir, address)
    profile["plot"] = publish_profile_task(dataset_dir, profile)
    return profile
