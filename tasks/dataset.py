"""Prefect tasks over dataset generation, preprocessing and profiling (thin wrappers)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prefect import get_run_logger

from dlrmflow.datasets import synthetic
from dlrmflow.datasets.preprocess import run_preprocess
from dlrmflow.datasets.preprocess_config import PreprocessConfig, PreprocessResult
from dlrmflow.engine.planning import profile as skew
from dlrmflow.engine.planning.profile import ProfileConfig, ProfileResult
from dlrmflow.engine.serving.cluster import dask_client
from dlrmflow.engine.up_to_date import saved_result
from dlrmflow.tasks import task
from dlrmflow.tasks.reporting import (
    Column,
    FlowProgress,
    artifact_key,
    dataset_label,
    format_table,
    publish_plot,
    publish_table,
)

SKEW_COLUMNS = [Column("Table", "table"), Column("Rows", "rows", "count"),
                Column("Touched rows", "touched_rows", "count"), Column("Accesses", "accesses", "count"),
                Column("Top 1% of rows take", "top1pct_share", "%")]


def generate_record(output: str) -> Path:
    """Where generate records what ``output`` was made from (its parameters and size) and its result."""
    return Path(f"{output}.params.json")


def generated_file_is_current(output: str, params: dict[str, Any]) -> dict[str, Any] | None:
    """The earlier result if ``output`` was generated with exactly ``params`` and is unchanged (same size)."""
    if not Path(output).is_file():
        return None
    earlier = saved_result(generate_record(output), {"params": params, "bytes": Path(output).stat().st_size})
    return None if earlier is None else earlier["result"]


@task(name="generate-criteo-tsv")
def generate_task(output: str, rows: int, seed: int, scale: float, dask_address: str | None) -> dict[str, Any]:
    params = {"rows": rows, "seed": seed, "scale": scale}
    progress = FlowProgress("generated rows")
    earlier = generated_file_is_current(output, params)
    if earlier is not None:
        get_run_logger().info("%s is up to date (rows=%d, seed=%d, scale=%g): skipped", output, rows, seed, scale)
        progress.finish()
        return {**earlier, "skipped": True}
    with dask_client(dask_address) as client:
        result = synthetic.generate(output, rows, seed=seed, scale=scale, client=client, progress=progress)
    progress.finish()
    side = {"params": params, "bytes": Path(output).stat().st_size, "result": result}
    generate_record(output).write_text(json.dumps(side, indent=2) + "\n")
    return {**result, "skipped": False}


@task(name="preprocess-to-parquet")
def preprocess_task(config: PreprocessConfig, force: bool, dask_address: str | None) -> PreprocessResult:
    progress = FlowProgress("preprocess steps")
    with dask_client(dask_address) as client:
        result = run_preprocess(config, client=client, progress=progress, force=force)
    progress.finish()  # also when skipped as up to date: nothing left to do
    return result


@task(name="count-accesses")
def profile_task(config: ProfileConfig, dask_address: str | None) -> ProfileResult:
    progress = FlowProgress("tables counted")
    with dask_client(dask_address) as client:
        profile, _ = skew.profile_dataset(config.dataset_dir, client=client, progress=progress)
    progress.finish()
    skew.write_profile(config.dataset_dir, profile)
    return ProfileResult.of(profile)


@task(name="publish-skew-report")
def publish_profile_task(dataset_dir: str, profile: ProfileResult) -> str:
    """The skew table (``skew-profile-<dataset>``) and coverage plot (``skew-coverage-<dataset>``); returns the PNG."""
    png = skew.plot_coverage(profile.as_dict(), Path(dataset_dir) / skew.PLOT_FILE)
    rows = [*profile.tables, {"table": "all tables", "rows": profile.total_rows, "touched_rows": profile.touched_rows,
                              "accesses": profile.accesses, "top1pct_share": profile.top1pct_share}]
    name = dataset_label(dataset_dir)
    publish_table(artifact_key("skew-profile", name), format_table(rows, SKEW_COLUMNS),
                  f"Per-table access skew of {dataset_dir}")
    publish_plot(artifact_key("skew-coverage", name), png,
                 f"Coverage curve of {name}: share of accesses vs share of rows")
    return str(png)
