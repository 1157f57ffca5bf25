"""dlrmflow plan: the lookahead cache plan of a dataset (Bagpipe's oracle cacher) as a Dask job."""

from __future__ import annotations

import argparse
from typing import Any

from dlrmflow.commands import (  # noqa: F401  (cli: the flow always starts a LocalCluster; no torch there)
    starts_local_cluster,
    workers_use_torch,
)
from dlrmflow.commands.options import add_config_options, checked_config
from dlrmflow.engine.planning.planner import PlanJobConfig

NAME = "plan"
HELP = "plan the embedding cache ahead of training: per-iteration prefetches, cache slots and evictions"
# Metavars of the options whose value is not a plain word (shared with compare-caches).
FLOWS = ("dlrmflow.flows.plan",)  # cli.import_flows
METAVARS = {"batch_size": "B", "lookahead": "L", "prefetch_distance": "P", "capacity": "ROWS",
            "output_dir": "PLAN_DIR", "chunk_iterations": "N"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One option per PlanJobConfig field: the plan's settings, the dataset, the plan directory, the chunks."""
    from dlrmflow.cli import add_dask_argument

    add_config_options(parser, PlanJobConfig, METAVARS)
    add_dask_argument(parser)


def check(args: argparse.Namespace) -> None:
    """The options' checks, before Prefect or Dask load (PlanError names a bad field)."""
    checked_config(args, PlanJobConfig)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from dlrmflow.flows.plan import plan_flow

    config = checked_config(args, PlanJobConfig)  # PlanError names a bad field, before a cluster starts
    return plan_flow(config, args.dask_address).as_dict()


def summarize(r: dict[str, Any]) -> str:
    from dlrmflow.commands.units import per_second

    c = r["counts"]
    bound = "unbounded" if r["capacity"] is None else f"capacity {r['capacity']:,} rows"
    return "\n".join([
        f"planned {r['num_iterations']:,} iterations (batch {r['batch_size']:,}, L={r['lookahead']}, "
        f"P={r['prefetch_distance']}, {bound})",
        f"prefetched rows {c['prefetched_rows']:,}, evicted rows {c['evicted_rows']:,}, "
        f"peak cache {c['peak_occupancy']:,} rows, cache slots {r['num_slots']:,}",
        f"{c['ids']:,} ids in {r['seconds']:.2f} s on {r['dask_workers']} Dask workers: "
        f"{per_second(r['ids_per_second'], 'ids')}, {per_second(r['iterations_per_second'], 'iterations')}",
        f"plan: {r['output']}",
    ])
