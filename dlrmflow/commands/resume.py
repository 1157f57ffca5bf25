"""dlrmflow resume: continue an unfinished training run from its last checkpoint.

The run directory says everything: run_config.json holds the configuration the run started with
(``dlrmflow train ... --checkpoint-every N``), checkpoint.pt the state to continue from. The
resumed run ends bit-identical to an uninterrupted one and writes the same files.
"""

from __future__ import annotations

import argparse
from typing import Any

from dlrmflow.commands import train

NAME = "resume"
HELP = "resume an unfinished training run (trained with --checkpoint-every) from its last checkpoint"
FLOWS = ("dlrmflow.flows.train", "torch._inductor.config", "matplotlib.pyplot")  # cli.import_flows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from dlrmflow.cli import add_dask_argument

    parser.add_argument("run_dir", metavar="RUN_DIR", help="the --output of the unfinished `dlrmflow train` run")
    add_dask_argument(parser)


def resumed_config(run_dir: str):
    """The TrainConfig of the unfinished run in ``run_dir`` (its run_config.json), with ``resume=True``;
    ResumeError when the directory holds no unfinished run with a checkpoint."""
    from dlrmflow.engine.training.config import TrainConfig
    from dlrmflow.engine.training.run_directory import check_unfinished

    saved = check_unfinished(run_dir)["config"]
    return TrainConfig(**{**saved, "output_dir": str(run_dir), "resume": True})


def check(args: argparse.Namespace) -> None:
    """The run directory's checks, before Prefect, torch or Dask load (run_directory and TrainConfig are
    light modules): a directory that cannot be resumed is refused in a fraction of a second."""
    args.config = resumed_config(args.run_dir)


def starts_local_cluster(args: argparse.Namespace) -> bool:
    """As the run it resumes (its TrainConfig has the options' names)."""
    return train.starts_local_cluster(args.config)


def trains_on_cluster(args: argparse.Namespace) -> bool:
    return train.trains_on_cluster(args.config)


def workers_use_torch(args: argparse.Namespace) -> bool:
    return train.workers_use_torch(args.config)


def run(args: argparse.Namespace) -> dict[str, Any]:
    config = getattr(args, "config", None) or resumed_config(args.run_dir)  # main() made it in check()
    return train.run_training(config, args.dask_address)


def summarize(result: dict[str, Any]) -> str:
    return train.summarize(result)
