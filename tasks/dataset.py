"""Prefect tasks over dataset generation, preprocessing and profiling (thin wrappers)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task

from dlrmflow.datasets import synthetic
from dlrmflow.datasets.preprocess import preprocess
from dlrmflow.engine import profile as skew
from dlrmflow.engine.cluster import dask_client
from dlrmflow.tasks.reporting import FlowProgress, publish_plot, publish_table
from dlrmflow.up_to_date import saved_result


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
    earlier = generated_file_is_current(output, params)
    if earlier is not None:
        get_run_logger().info("%s is up to date (rows=%d, seed=%d, scale=%g): skipped", output, rows, seed, scale)
        return {**earlier, "skipped": True}
    with dask_client(dask_address) as client:
        result = synthetic.generate(
            output, rows, seed=seed, scale=scale, client=client, progress=FlowProgress("generated chunks")
        )
    side = {"params": params, "bytes": Path(output).stat().st_size, "result": result}
    generate_record(output).write_text(json.dumps(side, indent=2) + "\n")
    return {**result, "skipped": False}


@task(name="preprocess-to-parquet")
def preprocess_task(inputs: list[str], output: str, options: dict[str, Any],
                    dask_address: str | None) -> dict[str, Any]:
    with dask_client(dask_address) as client:
        return preprocess(inputs, output, client=client, progress=FlowProgress("preprocess steps"), **options)


@task(name="count-accesses")
def profile_task(dataset_dir: str, dask_address: str | None) -> dict[str, Any]:
    with dask_client(dask_address) as client:
        profile, _ = skew.profile_dataset(dataset_dir, client=client, progress=FlowProgress("tables counted"))
    skew.write_profile(dataset_dir, profile)
    return profile


@task(name="publish-skew-report")
def publish_profile_task(dataset_dir: str, profile: dict[str, Any]) -> str:
    png = skew.plot_coverage(profile, Path(dataset_dir) / skew.PLOT_FILE)
    rows = [
        {k: t[k] for k in ("table", "rows", "touched_rows", "accesses", "top1pct_share")} for t in profile["tables"]
    ]
    rows.append({"table": "ALL", "rows": profile["total_rows"], "touched_rows": profile["touched_rows"],
                 "accesses": profile["accesses"], "top1pct_share": profile["top1pct_share"]})
    publish_table("skew-profile", rows, f"Per-table access skew of {dataset_dir}")
    publish_plot("skew-coverage", png, "Coverage curve: share of accesses vs share of rows")
    return str(png)
