"""dlrmflow profile: per-table access counts and the skew report of a dataset."""

from __future__ import annotations

import argparse
from typing import Any

from dlrmflow.commands import (  # noqa: F401  (cli: the flow always starts a LocalCluster; no torch there)
    starts_local_cluster,
    workers_use_torch,
)
from dlrmflow.commands.options import add_config_options, checked_config
from dlrmflow.engine.planning.profile import ProfileConfig

NAME = "profile"
HELP = "count embedding-row accesses and report the skew (profile.json + coverage plot)"
FLOWS = ("dlrmflow.flows.dataset", "matplotlib.pyplot")  # cli.import_flows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from dlrmflow.cli import add_dask_argument

    add_config_options(parser, ProfileConfig)
    add_dask_argument(parser)


def check(args: argparse.Namespace) -> None:
    """The options' checks, before Prefect or Dask load."""
    checked_config(args, ProfileConfig)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from dlrmflow.flows.dataset import profile_flow

    result = profile_flow(checked_config(args, ProfileConfig), args.dask_address)
    return result.as_dict(coverage=False)  # the curve is in profile.json; keep the JSON line readable


def summarize(r: dict[str, Any]) -> str:
    lines = [
        f"{r['samples']:,} samples, {r['accesses']:,} embedding accesses over {r['total_rows']:,} rows "
        f"({r['touched_rows']:,} touched)",
        f"top 1% of rows ({r['top1pct_rows']:,}) take {100 * r['top1pct_share']:.1f}% of accesses "
        f"(top 0.1%: {100 * r['top0.1pct_share']:.1f}%, top 10%: {100 * r['top10pct_share']:.1f}%)",
        "",
        f"{'table':>6} {'rows':>10} {'touched':>10} {'top-1% share':>13}",
    ]
    for t in r["tables"]:
        lines.append(f"{t['table']:>6} {t['rows']:>10,} {t['touched_rows']:>10,} {100 * t['top1pct_share']:>12.1f}%")
    lines += ["", f"profile: {r['dataset']}/profile.json   plot: {r['plot']}"]
    return "\n".join(lines)
