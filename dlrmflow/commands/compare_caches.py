"""dlrmflow compare-caches: rows fetched by no cache, LRU, a static hot set, the oracle plan, Belady MIN."""

from __future__ import annotations

import argparse
from typing import Any

from dlrmflow.commands.options import add_config_options, config_values
from dlrmflow.commands.plan import METAVARS
from dlrmflow.engine.planning.planner import PlanConfig
from dlrmflow.engine.training.config import TrainConfig

NAME = "compare-caches"
HELP = "simulate cache policies on one batch stream: rows fetched, bytes, write-backs, hit rate"
# The oracle's settings are the plan's (PlanConfig; the capacity here is a list); the row width is training's.
FLOWS = ("dlrmflow.flows.plan", "matplotlib.pyplot")  # cli.import_flows
PLAN_FIELDS = ("batch_size", "lookahead", "prefetch_distance", "drop_last")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dataset", metavar="DATASET_DIR", help="a preprocessed dataset directory")
    add_config_options(parser, PlanConfig, METAVARS, fields=PLAN_FIELDS)
    parser.add_argument("--capacity", action="append", required=True, metavar="ROWS",
                        help="cache rows, or a share of all rows like 1%%; repeat for several")
    add_config_options(parser, TrainConfig, {"embedding_dim": "D"}, fields=("embedding_dim",))
    parser.add_argument("--output", default=None, metavar="DIR",
                        help="where cache_policies.json/.png go (default: the dataset directory)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from dlrmflow.datasets.meta import read_meta
    from dlrmflow.engine.planning.cache_policies import parse_capacity
    from dlrmflow.flows.plan import compare_caches_flow

    meta = read_meta(args.dataset)  # clear errors before any work starts
    PlanConfig(**{name: value for name, value in config_values(args, PlanConfig).items() if name in PLAN_FIELDS})
    for c in args.capacity:
        parse_capacity(c, meta.total_embedding_rows)
    return compare_caches_flow(args.dataset, args.batch_size, args.capacity, args.lookahead,
                               args.prefetch_distance, args.embedding_dim, args.output, args.drop_last,
                               feasible_only=False)


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
