"""dlrmflow evaluate: a finished run's model scored on a dataset, without training.

The daily loop's progressive validation: yesterday's model on today's data before it trains on it. The
dataset must be the run's or one whose vocabulary grew from it (``dlrmflow preprocess --vocabulary``).
"""

from __future__ import annotations

import argparse
from typing import Any

NAME = "evaluate"
HELP = ("score a finished run's model on a dataset (its own, or a later day's preprocessed with --vocabulary): "
        "AUC, log loss and the constant-prediction log loss, without training")
FLOWS = ("dlrmflow.flows.evaluate", "torch._inductor.config")  # cli.import_flows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the --output directory of a finished `dlrmflow train`")
    parser.add_argument("dataset_dir", metavar="DATASET_DIR", help="a preprocessed dataset directory")
    parser.add_argument("--batch-size", type=int, default=4096, metavar="B", help="rows per step (default 4096)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--score-on", choices=("auto", "cluster", "process"), default="auto",
                        help="where the rows are scored: parts as Dask tasks on the cluster, or this process "
                             "(default auto: the cluster when --dask-address or $DLRMFLOW_DASK_ADDRESS is set or "
                             "the dataset has at least 524,288 rows; below that a LocalCluster's start costs more "
                             "than it saves)")
    from dlrmflow.cli import add_dask_argument

    add_dask_argument(parser)


def check(args: argparse.Namespace) -> None:
    """Before Prefect, torch or Dask load: a finished run, a dataset directory, a batch size."""
    from dlrmflow.datasets.meta import read_meta
    from dlrmflow.engine.errors import UserInputError
    from dlrmflow.engine.training.continuation import parent_cardinalities, read_finished_run

    if args.batch_size < 1:
        raise UserInputError(f"--batch-size must be >= 1, got {args.batch_size}")
    run = read_finished_run(args.run_dir, option="RUN_DIR")
    parent_cardinalities(run, read_meta(args.dataset_dir), f"RUN_DIR {args.run_dir}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from dlrmflow.flows.evaluate import evaluate_flow

    return evaluate_flow(args.run_dir, args.dataset_dir, args.batch_size, args.device, args.dask_address,
                         args.score_on)


def summarize(r: dict[str, Any]) -> str:
    def fixed(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.4f}"

    return "\n".join([
        f"evaluate {r['run_dir']} on {r['dataset']}: {r['rows']:,} rows"
        f"{' (parts on the Dask cluster)' if r.get('scored_on') == 'cluster' else ''}",
        f"  AUC                          {fixed(r['auc'])}",
        f"  log loss                     {fixed(r['log_loss'])}",
        f"  constant-prediction log loss {fixed(r['constant_log_loss'])} "
        f"(click rate {100 * (r['positive_rate'] or 0):.2f}%)",
        f"  ids new to the model         {r['new_ids']:,} ({100 * r['new_id_lookup_share']:.2f}% of lookups)",
    ])
