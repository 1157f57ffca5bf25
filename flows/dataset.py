"""Dataset flows: generate synthetic raw data, preprocess raw files, profile the access skew."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from prefect import get_run_logger

from dlrmflow.datasets.meta import read_meta
from dlrmflow.datasets.preprocess_config import PreprocessConfig, PreprocessResult
from dlrmflow.engine.planning.profile import ProfileConfig, ProfileResult
from dlrmflow.flows.prefect_internals import flow
from dlrmflow.flows.run_names import generate_run_name, preprocess_run_name, profile_run_name
from dlrmflow.tasks.dataset import generate_task, preprocess_task, profile_task, publish_profile_task
from dlrmflow.tasks.reporting import reported_dask_scheduler


@flow(name="generate", flow_run_name=generate_run_name)
def generate_flow(output: str, rows: int, seed: int = 0, scale: float = 1.0,
                  dask_address: str | None = None) -> dict[str, Any]:
    """Write a synthetic dataset in the raw Criteo TSV format."""
    with reported_dask_scheduler(dask_address) as address:
        return generate_task(output, rows, seed, scale, address)


@flow(name="preprocess", flow_run_name=preprocess_run_name)
def preprocess_flow(config: PreprocessConfig, force: bool = False,
                    dask_address: str | None = None) -> PreprocessResult:
    """Raw files -> shuffled Parquet dataset with frequency-ordered ids, as ``config`` says (a
    PreprocessConfig: needs ``inputs`` and ``output``); skipped when up to date, unless ``force``."""
    with reported_dask_scheduler(dask_address) as address:
        result = preprocess_task(config, force, address)
    logger = get_run_logger()
    if result.skipped:
        logger.info("%s is up to date (same inputs and parameters): nothing to do", config.output)
    if result.rejected_rows:
        logger.warning("%d rows rejected (%s); see %s", result.rejected_rows, result.rejected_by_reason,
                       result.rejected_file)
    return result


@flow(name="profile", flow_run_name=profile_run_name)
def profile_flow(config: ProfileConfig, dask_address: str | None = None) -> ProfileResult:
    """Per-table access counts of ``config.dataset_dir`` -> profile.json, coverage plot and a skew table artifact."""
    read_meta(config.dataset_dir)  # a clear error before a cluster starts
    with reported_dask_scheduler(dask_address) as address:
        profile = profile_task(config, address)
    return replace(profile, plot=publish_profile_task(config.dataset_dir, profile))
