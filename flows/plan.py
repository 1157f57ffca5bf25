"""Flows of the oracle cacher: make a lookahead plan (a Dask job), compare cache policies."""

from __future__ import annotations

from typing import Any

from prefect import flow

from dlrmflow.engine.planning.planner import PlanConfig
from dlrmflow.engine.serving.cluster import dask_scheduler
from dlrmflow.flows.run_names import compare_caches_run_name, plan_run_name
from dlrmflow.tasks.plan import compare_task, plan_task, publish_comparison_task, publish_plan_task


@flow(name="plan", flow_run_name=plan_run_name)
def plan_flow(
    dataset_dir: str,
    output_dir: str,
    batch_size: int,
    lookahead: int = 200,
    prefetch_distance: int = 1,
    capacity: int | None = None,
    drop_last: bool = False,
    chunk_iterations: int | None = None,
    dask_address: str | None = None,
) -> dict[str, Any]:
    """Dataset -> plan directory (per-iteration prefetches, slots, evictions) + a summary artifact."""
    config = PlanConfig(batch_size, lookahead, prefetch_distance, capacity, drop_last)  # fail before Dask starts
    with dask_scheduler(dask_address) as address:
        summary = plan_task(dataset_dir, config, output_dir, chunk_iterations, address)
    publish_plan_task(summary, dataset_dir)
    return summary


@flow(name="compare-caches", flow_run_name=compare_caches_run_name)
def compare_caches_flow(
    dataset_dir: str,
    batch_size: int,
    capacities: list[str | int],
    lookahead: int = 200,
    prefetch_distance: int = 1,
    embedding_dim: int = 16,
    output_dir: str | None = None,
    drop_last: bool = False,
) -> dict[str, Any]:
    """No cache, LRU, static hot set, oracle plan, Belady MIN on one stream: table + plot artifacts."""
    report = compare_task(dataset_dir, batch_size, capacities, lookahead, prefetch_distance, embedding_dim,
                          drop_last)
    report.update(publish_comparison_task(report, output_dir or dataset_dir))
    return report
