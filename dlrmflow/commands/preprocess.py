"""dlrmflow preprocess: raw Criteo/Avazu files -> a shuffled Parquet dataset."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from dlrmflow.commands import (  # noqa: F401  (cli: the flow always starts a LocalCluster; no torch there)
    starts_local_cluster,
    workers_use_torch,
)
from dlrmflow.commands.options import add_config_options, checked_config
from dlrmflow.datasets.preprocess_config import PreprocessConfig

NAME = "preprocess"
HELP = "turn raw Criteo/Avazu files into a shuffled Parquet dataset with meta.json"
FLOWS = ("dlrmflow.flows.dataset",)  # cli.import_flows
METAVARS = {"output": "DIR", "min_frequency": "N", "max_rows_per_table": "ROWS", "max_reject_fraction": "F",
            "block_bytes": "BYTES"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One option per PreprocessConfig field (its type, default, bounds and help), then --force."""
    from dlrmflow.cli import add_dask_argument

    add_config_options(parser, PreprocessConfig, METAVARS)
    parser.add_argument("--force", action="store_true", help="redo the work even if the output is up to date")
    add_dask_argument(parser)


def check(args: argparse.Namespace) -> None:
    """The options' checks, before Prefect or Dask load (PreprocessConfigError names a bad field; a
    --vocabulary that cannot serve is a DatasetError naming why)."""
    config = checked_config(args, PreprocessConfig)
    if config.vocabulary is not None:
        from dlrmflow.datasets.formats import get_format
        from dlrmflow.datasets.vocabulary import load_parent, refuse_processed_inputs

        parent = load_parent(config.vocabulary, source_format=config.format,
                             max_rows_per_table=config.max_rows_per_table,
                             sparse_columns=get_format(config.format).sparse)
        refuse_processed_inputs([Path(p).resolve() for p in config.inputs], parent)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from dlrmflow.flows.dataset import preprocess_flow

    config = checked_config(args, PreprocessConfig)  # PreprocessConfigError names a bad field
    return preprocess_flow(config, force=args.force, dask_address=args.dask_address).as_dict()


def summarize(r: dict[str, Any]) -> str:
    if r["skipped"]:
        head = f"{r['dataset']} is up to date (same inputs and parameters): skipped"
    else:
        head = (f"preprocessed {r['rows']:,} rows into {r['dataset']} ({r['files']} Parquet files) "
                f"in {r['seconds']:.1f} s ({r['rows_per_second']:,} rows/s)")
    lines = [head, f"{r['tables']} tables, {r['embedding_rows']:,} embedding rows; "
                   f"largest table {max(r['cardinalities']):,} rows"]
    if r["rejected_rows"]:
        reasons = ", ".join(f"{n} x {why}" for why, n in r["rejected_by_reason"].items())
        lines.append(f"rejected {r['rejected_rows']:,} rows ({reasons}); see {r['rejected_file']}")
    else:
        lines.append("rejected 0 rows")
    return "\n".join(lines)
