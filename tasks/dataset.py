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


def _sidecar(output: str) -> Path:
    return Path(f"{output}.params.json")


def generated_file_is_current(output: str, params: dict[str, Any]) -> dict[str, Any] | None:
    """The earlier result if ``output`` was generated with exactly ``params`` and is unchanged."""
    side = _sidecar(output)
    if not (side.is_file() and Path(output).is_file()):
        return None
    earlier = json.loads(side.read_text())
    same = earlier.get("params") == params and earlier.get("bytes") == Path(output).stat().st_size
    return earlier["result"] if same else None


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
    _sidecar(output).write_text(json.dumps(side, indent=2) + "\n")
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
