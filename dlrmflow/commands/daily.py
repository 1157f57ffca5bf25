"""dlrmflow daily: the daily loop over a landing directory of day files (what the nightly deployment runs)."""

from __future__ import annotations

import argparse
from typing import Any

from dlrmflow.commands import starts_local_cluster  # noqa: F401  (cli: the flow always starts a LocalCluster)

NAME = "daily"
HELP = ("each day file of LANDING not yet processed: preprocess with the previous day's vocabulary, plan, "
        "evaluate the latest model on it, train from it (oracle, parity); the day-by-day table")
FLOWS = ("dlrmflow.flows.daily", "torch._inductor.config", "matplotlib.pyplot")  # cli.import_flows

OPTIONS = ("format", "min_frequency", "max_rows_per_table", "seed", "model", "embedding_dim", "batch_size",
           "lookahead", "prefetch_distance", "shards", "parity", "lr")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from dlrmflow.cli import add_dask_argument
    from dlrmflow.flows.daily_config import DailyConfig

    fields = DailyConfig.model_fields
    parser.add_argument("landing", metavar="LANDING", help=fields["landing"].description)
    parser.add_argument("--state-dir", required=True, metavar="STATE", help=fields["state_dir"].description)
    for name in OPTIONS:
        field = fields[name]
        kind = type(field.default) if field.default is not None else int
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=field.default,
                            help=f"{field.description or name} (default {field.default})")
    add_dask_argument(parser)


def config_from_args(args: argparse.Namespace):
    from dlrmflow.flows.daily_config import DailyConfig

    return DailyConfig(landing=args.landing, state_dir=args.state_dir, dask_address=args.dask_address,
                       **{name: getattr(args, name) for name in OPTIONS})


def check(args: argparse.Namespace) -> None:
    """The parameters and the landing, before Prefect, torch or Dask load."""
    args.config = config_from_args(args)
    args.config.day_files()


def run(args: argparse.Namespace) -> dict[str, Any]:
    from dlrmflow.flows.daily import daily_flow

    return daily_flow(getattr(args, "config", None) or config_from_args(args))


def summarize(r: dict[str, Any]) -> str:
    from dlrmflow.tasks.daily import daily_table

    if not r["new_days"]:
        return f"nothing new: {len(r['days'])} day(s) already processed in {r['state_dir']}"
    return "\n".join([f"daily loop in {r['state_dir']}: trained {', '.join(r['new_days'])}", "",
                      daily_table(r["days"])])
