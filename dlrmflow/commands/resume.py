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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from dlrmflow.cli import add_dask_argument

    parser.add_argument("run_dir", metavar="RUN_DIR", help="the --output of the unfinished `dlrmflow train` run")
    add_dask_argument(parser)


def resumed_config(run_dir: str):
    """The TrainConfig of the run in ``run_dir`` (its run_config.json), with ``resume=True``."""
    from dlrmflow.engine.training.checkpoint import read_run_config
    from dlrmflow.engine.training.config import TrainConfig

    saved = read_run_config(run_dir)["config"]  # ResumeError if the directory holds no checkpointed run
    return TrainConfig(**{**saved, "output_dir": str(run_dir), "resume": True})


def run(args: argparse.Namespace) -> dict[str, Any]:
    return train.run_training(resumed_config(args.run_dir), args.dask_address)


def summarize(result: dict[str, Any]) -> str:
    return train.summarize(result)
