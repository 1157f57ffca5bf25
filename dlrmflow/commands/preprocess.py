"""dlrmflow preprocess: raw Criteo/Avazu files -> a shuffled Parquet dataset."""

from __future__ import annotations

import argparse
from typing import Any

from dlrmflow.datasets.formats import FORMATS

NAME = "preprocess"
HELP = "turn raw Criteo/Avazu files into a shuffled Parquet dataset with meta.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from dlrmflow.cli import add_dask_argument

    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="raw input files (plain or .gz)")
    parser.add_argument("--output", required=True, metavar="DIR", help="dataset directory to write")
    parser.add_argument("--format", default="criteo", choices=list(FORMATS),
                        help="criteo: raw TSV (Kaggle/Terabyte); criteo-csv: CSV with header; avazu: CSV")
    parser.add_argument("--seed", type=int, default=0, help="shuffle seed")
    parser.add_argument("--min-frequency", type=int, default=1,
                        help="categorical values seen fewer times map to id 0 (default 1: keep all)")
    parser.add_argument("--max-rows-per-table", type=int, default=None,
                        help="hash cap: fold raw values into this many rows per table (row 0 included)")
    parser.add_argument("--max-reject-fraction", type=float, default=0.01,
                        help="fail when more than this fraction of rows is malformed (default 0.01)")
    parser.add_argument("--force", action="store_true", help="redo the work even if the output is up to date")
    add_dask_argument(parser)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from dlrmflow.flows.dataset import preprocess_flow

    return preprocess_flow(
        inputs=args.inputs, output=args.output, format=args.format, seed=args.seed,
        min_frequency=args.min_frequency, max_rows_per_table=args.max_rows_per_table,
        max_reject_fraction=args.max_reject_fraction, force=args.force, dask_address=args.dask_address,
    )


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
