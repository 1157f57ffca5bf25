"""Prefect tasks of the oracle cacher and the cache-policy comparison (thin wrappers)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from dlrmflow.engine.planning import cache_policies
from dlrmflow.engine.planning.planner import PlanJobConfig, PlanResult, make_plan
from dlrmflow.engine.serving.cluster import cluster_workers, dask_client
from dlrmflow.tasks import task
from dlrmflow.tasks.reporting import (
    Column,
    FlowProgress,
    artifact_key,
    dataset_label,
    format_table,
    metric_table,
    publish_plot,
    publish_table,
)

COMPARISON_FILE = "cache_policies.json"
COMPARISON_PLOT = "cache_policies.png"
COMPARISON_COLUMNS = [
    Column("Policy", "policy"), Column("Capacity (rows)", "capacity", "count"),
    Column("Rows fetched", "rows_fetched", "count"),
    Column("Fetched", "bytes_fetched", "MB"), Column("Rows written back", "rows_written_back", "count"),
    Column("Hit rate", "hit_rate", "%"), Column("Note", "note"),
]


def plan_key(base: str, dataset_dir: str, batch_size: int, lookahead: int | None = None) -> str:
    """``base-<dataset>-b<batch>[-l<L>]``: a key's history holds plans (comparisons) of like settings only."""
    return artifact_key(base, dataset_label(dataset_dir), f"b{batch_size}", f"l{lookahead}" if lookahead else "")


@task(name="plan-lookahead-cache")
def plan_task(config: PlanJobConfig, dask_address: str | None) -> PlanResult:
    progress = FlowProgress("plan: tasks decided, then chunks assembled")  # in_stages: the planner
    with dask_client(dask_address) as client:
        started = time.perf_counter()
        record = make_plan(config.dataset_dir, config.settings(), config.output_dir, client=client,
                           chunk_iterations=config.chunk_iterations, progress=progress)
        seconds = time.perf_counter() - started
        progress.finish()
        workers = len(cluster_workers(client))
    return PlanResult.of(record, config.output_dir, seconds=seconds, dask_workers=workers)


@task(name="publish-plan-summary")
def publish_plan_task(plan: PlanResult, dataset_dir: str) -> str:
    """The plan's figures as a table, key ``lookahead-plan-<dataset>-b<batch>-l<L>``; returns the key."""
    config, counts = plan.config, plan.counts
    table = metric_table([
        ("Iterations", plan.num_iterations, "count"), ("Batch size", config.batch_size, "count"),
        ("Lookahead (L)", config.lookahead, "count"), ("Prefetch distance (P)", config.prefetch_distance, "count"),
        ("Capacity (rows)", config.capacity if config.capacity is not None else "unbounded", "count"),
        ("Cache slots", plan.num_slots, "count"), ("Rows prefetched", counts["prefetched_rows"], "count"),
        ("Rows evicted", counts["evicted_rows"], "count"), ("Peak occupancy (rows)", counts["peak_occupancy"], "count"),
        ("Ids planned", counts["ids"], "count"), ("Planning time", plan.seconds, "s"),
        ("Ids per second", plan.ids_per_second, "count"), ("Dask workers", plan.dask_workers, "count"),
    ])
    return publish_table(plan_key("lookahead-plan", dataset_dir, config.batch_size, config.lookahead), table,
                         f"Lookahead plan written to {plan.output}")


@task(name="simulate-cache-policies")
def compare_task(dataset_dir: str, batch_size: int, capacities: list[str | int], lookahead: int,
                 prefetch_distance: int, embedding_dim: int, drop_last: bool, feasible_only: bool = False
                 ) -> dict[str, Any]:
    progress = FlowProgress("policy simulations done")
    report = cache_policies.compare_dataset(
        dataset_dir, batch_size, capacities, window=lookahead, distance=prefetch_distance,
        embedding_dim=embedding_dim, drop_last=drop_last, progress=progress, feasible_only=feasible_only,
    )
    progress.finish()
    return report


def _left_out(report: dict[str, Any]) -> str:
    """What the table says of the sweep's capacities it left out (too small for some policy), if any."""
    left_out = report.get("left_out") or []
    if not left_out:
        return ""
    return (f"; capacities {', '.join(f'{c:,}' for c in left_out)} left out: below "
            f"{report['smallest_feasible']:,} rows some policy cannot run")


@task(name="publish-cache-comparison")
def publish_comparison_task(report: dict[str, Any], output_dir: str) -> dict[str, str]:
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / COMPARISON_FILE).write_text(json.dumps(report, indent=2) + "\n")
    results = cache_policies.results_from_rows(report["rows"], report["uses"])
    png = cache_policies.plot_comparison(
        results, out / COMPARISON_PLOT,
        title=f"Rows fetched, batch {report['batch_size']}, L={report['lookahead']}, P={report['prefetch_distance']}",
    )
    dataset, batch = report["dataset"], report["batch_size"]
    publish_table(plan_key("cache-policies", dataset, batch), format_table(report["rows"], COMPARISON_COLUMNS),
                  f"Cache policies on {report['dataset']} ({report['iterations']:,} iterations, "
                  f"{report['uses']:,} row uses, embedding dim {report['embedding_dim']}){_left_out(report)}")
    publish_plot(plan_key("cache-policies-plot", dataset, batch), png,
                 f"Rows fetched vs cache capacity, per policy ({dataset_label(dataset)}, batch {batch})")
    return {"report": str(out / COMPARISON_FILE), "plot": str(png)}
