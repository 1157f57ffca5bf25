"""dlrmflow compare-caches: rows fetched by no cache, LRU, a static hot set, the oracle plan, Belady MIN."""

from __future__ import annotations

import argparse
from typing import Any

NAME = "compare-caches"
HELP = "simulate cache policies on one batch stream: rows fetched, bytes, write-backs, hit rate"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dataset", metavar="DATASET_DIR", help="a preprocessed dataset directory")
    parser.add_argument("--batch-size", type=int, required=True, metavar="B", help="rows per iteration")
    parser.add_argument("--lookahead", type=int, default=200, metavar="L", help="oracle window (default 200)")
    parser.add_argument("--prefetch-distance", type=int, default=1, metavar="P",
                        help="oracle prefetch distance (default 1)")
    parser.add_argument("--capacity", action="append", required=True, metavar="ROWS",
                        help="cache rows, or a share of all rows like 1%%; repeat for several")
    parser.add_argument("--embedding-dim", type=int, default=16, metavar="D",
                        help="float32 values per row, for bytes fetched (default 16)")
    parser.add_argument("--drop-last", action="store_true", help="drop a final partial batch")
    parser.add_argument("--output", default=None, metavar="DIR",
                        help="where cache_policies.json/.png go (default: the dataset directory)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from dlrmflow.datasets.meta import read_meta
    from dlrmflow.engine.planning.cache_policies import parse_capacity
    from dlrmflow.engine.planning.planner import PlanConfig
    from dlrmflow.flows.plan import compare_caches_flow

    meta = read_meta(args.dataset)  # clear errors before any work starts
    PlanConfig(args.batch_size, args.lookahead, args.prefetch_distance)
    for c in args.capacity:
        parse_capacity(c, meta.total_embedding_rows)
    return compare_caches_flow(args.dataset, args.batch_size, args.capacity, args.lookahead,
                               args.prefetch_distance, args.embedding_dim, args.output, args.drop_last)


def summarize(r: dict[str, Any]) -> str:
    lines = [
        f"{r['iterations']:,} iterations of batch {r['batch_size']:,}: {r['uses']:,} row uses "
        f"(per-iteration unique rows), {r['total_rows']:,} embedding rows, up to {r['max_batch_rows']:,} per iteration",
        "",
        f"{'capacity':>12} {'policy':>7} {'rows fetched':>14} {'MB fetched':>11} {'written back':>13} {'hit rate':>9}",
    ]
    for row in r["rows"]:
        capacity = "-" if row["capacity"] is None else f"{row['capacity']:,}"
        if row["rows_fetched"] is None:
            lines.append(f"{capacity:>12} {row['policy']:>7} {'infeasible':>14}   ({row['note']})")
            continue
        mb = row["bytes_fetched"] / 1e6
        lines.append(f"{capacity:>12} {row['policy']:>7} {row['rows_fetched']:>14,} {mb:>11,.1f} "
                     f"{row['rows_written_back']:>13,} {100 * row['hit_rate']:>8.1f}%")
    lines += ["", f"report: {r['report']}   plot: {r['plot']}"]
    return "\n".join(lines)
