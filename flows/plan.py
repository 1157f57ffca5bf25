"""Flows of the oracle cacher: make a lookahead plan (a Dask job), compare cache policies."""

from __future__ import annotations

from typing import Any

from dlrmflow.datasets.meta import read_meta
from dlrmflow.engine.planning.planner import PlanConfig, PlanJobConfig, PlanResult
from dlrmflow.engine.training.config import TrainConfig
from dlrmflow.flows.prefect_internals import flow
from dlrmflow.flows.run_names import compare_caches_run_name, plan_run_name
from dlrmflow.tasks.plan import compare_task, plan_task, publish_comparison_task, publish_plan_task
from dlrmflow.tasks.reporting import reported_dask_scheduler


@flow(name="plan", flow_run_name=plan_run_name)
def plan_flow(config: PlanJobConfig, dask_address: str | None = None) -> PlanResult:
    """Dataset -> plan directory (per-iteration prefetches, slots, evictions) + a summary artifact, as
    ``config`` says (a PlanJobConfig: needs ``dataset_dir``, ``output_dir`` and ``batch_size``)."""
    read_meta(config.dataset_dir)  # a clear error before a cluster starts
    with reported_dask_scheduler(dask_address) as address:
        plan = plan_task(config, address)
    publish_plan_task(plan, config.dataset_dir)
    return plan


@flow(name="compare-caches", flow_run_name=compare_caches_run_name)
def compare_caches_flow(
    dataset_dir: str,
    batch_size: int,
    capacities: list[str | int],
    lookahead: int = PlanConfig.default("lookahead"),
    prefetch_distance: int = PlanConfig.default("prefetch_distance"),
    embedding_dim: int = TrainConfig.default("embedding_dim"),
    output_dir: str | None = None,
    drop_last: bool = PlanConfig.default("drop_last"),
    feasible_only: bool = True,
) -> dict[str, Any]:
    """No cache, LRU, static hot set, oracle plan, Belady MIN on one stream: table + plot artifacts.

    ``feasible_only`` (a sweep, as the pipeline's): capacities too small for some policy are left out and the
    smallest at which every policy runs is compared instead, so that no row is empty; ``False``
    (``dlrmflow compare-caches``: the capacities the user asked for): each is reported, infeasible or not."""
    report = compare_task(dataset_dir, batch_size, capacities, lookahead, prefetch_distance, embedding_dim,
                          drop_last, feasible_only)
    report.update(publish_comparison_task(report, output_dir or dataset_dir))
    return report
