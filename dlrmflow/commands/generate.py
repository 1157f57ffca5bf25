"""dlrmflow generate: write a synthetic dataset in the raw Criteo TSV format."""

from __future__ import annotations

import argparse
from typing import Any

from dlrmflow.commands import (  # noqa: F401  (cli: the flow always starts a LocalCluster; no torch there)
    starts_local_cluster,
    workers_use_torch,
)
from dlrmflow.engine.errors import UserInputError

NAME = "generate"
HELP = "write a synthetic Criteo-format TSV (power-law skew like the real data)"
FLOWS = ("dlrmflow.flows.dataset",)  # cli.import_flows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from dlrmflow.cli import add_dask_argument

    parser.add_argument("--rows", type=int, required=True, help="number of rows to write")
    parser.add_argument("--output", required=True, metavar="FILE", help="output file (.gz to compress)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (same seed, same bytes)")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiply the 26 Criteo Kaggle table cardinalities by this (default 1.0)")
    add_dask_argument(parser)


def check(args: argparse.Namespace) -> None:
    """The options' checks, before Prefect or Dask load."""
    if args.rows < 1:
        raise UserInputError(f"--rows must be >= 1, got {args.rows}")
    if args.scale <= 0:
        raise UserInputError(f"--scale must be > 0, got {args.scale}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    check(args)
    from dlrmflow.flows.dataset import generate_flow

    return generate_flow(args.output, args.rows, args.seed, args.scale, args.dask_address)


def summarize(r: dict[str, Any]) -> str:
    from dlrmflow.commands.units import size

    return (
        f"wrote {r['rows']:,} rows ({size(r['bytes'])}) to {r['output']} in {r['seconds']:.1f} s "
        f"({r['rows'] / max(r['seconds'], 1e-9):,.0f} rows/s)\n"
        f"seed {r['seed']}, scale {r['scale']}: {len(r['cardinalities'])} tables, "
        f"{sum(r['cardinalities']):,} rows in all (largest {max(r['cardinalities']):,})"
    )
