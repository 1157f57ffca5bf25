"""Prefect tasks of the oracle cacher and the cache-policy comparison (thin wrappers)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from prefect import task

from dlrmflow.engine import cache_policies
from dlrmflow.engine.cluster import cluster_workers, dask_client
from dlrmflow.engine.planner import PlanConfig, make_plan
from dlrmflow.tasks.reporting import FlowProgress, publish_plot, publish_table

COMPARISON_FILE = "cache_policies.json"
COMPARISON_PLOT = "cache_policies.png"


@task(name="plan-lookahead-cache")
def plan_task(dataset_dir: str, config: PlanConfig, output_dir: str, chunk_iterations: int | None,
              dask_address: str | None) -> dict[str, Any]:
    with dask_client(dask_address) as client:
        started = time.perf_counter()
        summary = make_plan(dataset_dir, config, output_dir, client=client, chunk_iterations=chunk_iterations,
                            progress=FlowProgress("plan chunks done"))
        seconds = time.perf_counter() - started
        workers = len(cluster_workers(client))
    ids = summary["counts"]["ids"]
    return {**summary, "output": output_dir, "seconds": seconds, "dask_workers": workers,
            "ids_per_second": ids / seconds if seconds else None,
            "iterations_per_second": summary["num_iterations"] / seconds if seconds else None}


@task(name="publish-plan-summary")
def publish_plan_task(summary: dict[str, Any]) -> None:
    counts = summary["counts"]
    publish_table("lookahead-plan", [{
        "iterations": summary["num_iterations"], "batch_size": summary["batch_size"],
        "lookahead": summary["lookahead"], "prefetch_distance": summary["prefetch_distance"],
        "capacity": summary["capacity"], "num_slots": summary["num_slots"],
        "prefetched_rows": counts["prefetched_rows"], "evicted_rows": counts["evicted_rows"],
        "peak_occupancy": counts["peak_occupancy"], "ids": counts["ids"],
        "seconds": round(summary["seconds"], 3), "ids_per_second": round(summary["ids_per_second"] or 0),
    }], f"Lookahead plan written to {summary['output']}")


@task(name="simulate-cache-policies")
def compare_task(dataset_dir: str, batch_size: int, capacities: list[str | int], lookahead: int,
                 prefetch_distance: int, embedding_dim: int, drop_last: bool) -> dict[str, Any]:
    return cache_policies.compare_dataset(
        dataset_dir, batch_size, capacities, window=lookahead, distance=prefetch_distance,
        embedding_dim=embedding_dim, drop_last=drop_last, progress=FlowProgress("policy simulations done"),
    )


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
    publish_table("cache-policies", report["rows"],
                  f"Cache policies on {report['dataset']} ({report['iterations']} iterations, "
                  f"{report['uses']:,} row uses, embedding dim {report['embedding_dim']})")
    publish_plot("cache-policies-plot", png, "Rows fetched vs cache capacity, per policy")
    return {"report": str(out / COMPARISON_FILE), "plot": str(png)}
