"""dlrmflow predict: a finished run's model scores raw files or a preprocessed dataset into Parquet predictions.

Raw files (the run's format) are mapped through the run's dataset vocabulary as ``dlrmflow preprocess
--vocabulary`` maps them; values it never saw are counted. See docs/predict.md.
"""

from __future__ import annotations

import argparse
from typing import Any

NAME = "predict"
HELP = ("score raw files (the run's format) or a preprocessed dataset with a finished run's model: Parquet parts of "
        "row, click probability and label in a new directory; rows/s, new ids, and AUC and log loss with labels")
FLOWS = ("dlrmflow.flows.predict", "torch._inductor.config")  # cli.import_flows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the --output directory of a finished `dlrmflow train`")
    parser.add_argument("inputs", metavar="INPUT", nargs="+",
                        help="raw files of the run's format (plain or .gz), or one preprocessed dataset directory")
    parser.add_argument("--output", required=True, metavar="OUT",
                        help="the directory to write (must not exist, or be empty); written whole or not at all")
    parser.add_argument("--batch-size", type=int, default=4096, metavar="B",
                        help="rows per step (default 4096, the training's evaluation batch size)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--held-out", action="store_true",
                        help="score only the run's held-out rows (INPUT: the run's own dataset): the run's final "
                             "evaluation, bit for bit, with its evaluation batch size")
    parser.add_argument("--score-on", choices=("auto", "cluster", "process"), default="auto",
                        help="where the rows are scored: parts as Dask tasks on the cluster, or this process "
                             "(default auto: the cluster when --dask-address or $DLRMFLOW_DASK_ADDRESS is set or "
                             "there are at least 524,288 rows)")
    from dlrmflow.cli import add_dask_argument

    add_dask_argument(parser)


def check(args: argparse.Namespace) -> None:
    """Before Prefect, Dask or the model load: the run, its final state's files, the inputs, the output."""
    from dlrmflow.engine.errors import UserInputError
    from dlrmflow.engine.training.prediction import check_prediction

    if args.batch_size < 1:
        raise UserInputError(f"--batch-size must be >= 1, got {args.batch_size}")
    check_prediction(args.run_dir, args.inputs, args.output, held_out=args.held_out)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from dlrmflow.flows.predict import predict_flow

    return predict_flow(args.run_dir, list(args.inputs), args.output, args.batch_size, args.device,
                        args.dask_address, args.score_on, args.held_out)


def summarize(r: dict[str, Any]) -> str:
    def fixed(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.4f}"

    where = " (parts on the Dask cluster)" if r["scored_on"] == "cluster" else ""
    lines = [
        f"predict {r['run_dir']} on {', '.join(r['inputs'])}: {r['rows']:,} rows into {r['output']} "
        f"({r['parts']} Parquet part{'' if r['parts'] == 1 else 's'}){where}",
        f"  scored at {r['rows_per_second'] or 0:,} rows/s ({r['scoring_seconds']:.1f} s; {r['seconds']:.1f} s in all)",
        f"  ids new to the model         {r['new_ids']:,} ({100 * r['new_id_lookup_share']:.2f}% of lookups)",
    ]
    if r["rejected_rows"]:
        lines.append(f"  malformed input rows skipped {r['rejected_rows']:,}")
    if r["labelled"]:
        lines += [f"  AUC                          {fixed(r['auc'])}",
                  f"  log loss                     {fixed(r['log_loss'])}",
                  f"  constant-prediction log loss {fixed(r['constant_log_loss'])} "
                  f"(click rate {100 * (r['positive_rate'] or 0):.2f}%)"]
    return "\n".join(lines)
