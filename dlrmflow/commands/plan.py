"""dlrmflow plan: the lookahead cache plan of a dataset (Bagpipe's oracle cacher) as a Dask job."""

from __future__ import annotations

import argparse
from typing import Any

NAME = "plan"
HELP = "plan the embedding cache ahead of training: per-iteration prefetches, cache slots and evictions"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from dlrmflow.cli import add_dask_argument

    parser.add_argument("dataset", metavar="DATASET_DIR", help="a preprocessed dataset directory")
    parser.add_argument("--batch-size", type=int, required=True, metavar="B", help="rows per iteration")
    parser.add_argument("--lookahead", type=int, default=200, metavar="L",
                        help="keep a row cached when it is used again within L iterations (default 200)")
    parser.add_argument("--prefetch-distance", type=int, default=1, metavar="P",
                        help="iterations ahead a fetch is issued, 1 <= P <= L (default 1)")
    parser.add_argument("--capacity", type=int, default=None, metavar="ROWS",
                        help="cache rows (default: unbounded; with a bound, the rows used farthest ahead leave)")
    parser.add_argument("--drop-last", action="store_true", help="drop a final partial batch")
    parser.add_argument("--output", required=True, metavar="PLAN_DIR", help="plan directory to write")
    parser.add_argument("--chunk-iterations", type=int, default=None, metavar="N",
                        help="iterations per Dask task (default max(16L, 1024))")
    add_dask_argument(parser)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from dlrmflow.datasets.meta import read_meta
    from dlrmflow.engine.planning.planner import PlanConfig
    from dlrmflow.flows.plan import plan_flow

    read_meta(args.dataset)  # clear errors before a cluster starts
    PlanConfig(args.batch_size, args.lookahead, args.prefetch_distance, args.capacity, args.drop_last)
    return plan_flow(args.dataset, args.output, args.batch_size, args.lookahead, args.prefetch_distance,
                     args.capacity, args.drop_last, args.chunk_iterations, args.dask_address)


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
