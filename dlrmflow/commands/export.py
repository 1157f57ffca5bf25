"""dlrmflow export: a finished run's model written for TorchRec (docs/export.md).

A DLRM becomes the state dict of TorchRec's ``torchrec.models.dlrm.DLRM``; Wide & Deep, DeepFM and DCN-v2 (which
TorchRec does not have) a ``torch.export`` program; the vocabulary of the run's dataset goes beside it.
"""

from __future__ import annotations

import argparse
from typing import Any

NAME = "export"
HELP = ("write a finished run's model for TorchRec: TorchRec's DLRM state dict (a torch.export program for the "
        "other models) and its dataset's vocabulary, into a new directory")
FLOWS = ("dlrmflow.flows.export",)  # cli.import_flows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the --output directory of a finished `dlrmflow train`")
    # Checked in check(), not by argparse's choices: a bad value is one line on stderr, as every bad input.
    parser.add_argument("--to", default="torchrec", metavar="TARGET", help="what to export for: torchrec (default)")
    parser.add_argument("--output", required=True, metavar="DIR",
                        help="the directory to write (new, empty, or holding an earlier export, which is replaced)")


def check(args: argparse.Namespace) -> None:
    """Before Prefect or torch load: a known target, a finished run, an output directory free to write."""
    from dlrmflow.engine.training.continuation import read_finished_run
    from dlrmflow.engine.training.export_checks import check_output, check_target

    check_target(args.to)
    read_finished_run(args.run_dir, option="RUN_DIR")
    check_output(args.output)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from dlrmflow.flows.export import export_flow

    return export_flow(args.run_dir, args.output, args.to)


def summarize(r: dict[str, Any]) -> str:
    vocabulary_files = [f for f in r["files"] if f.startswith("vocabulary/")]
    files = ", ".join(f for f in r["files"] if f not in vocabulary_files) + \
        (f" and {len(vocabulary_files)} vocabulary files" if vocabulary_files else "")
    return "\n".join([
        f"export {r['run_dir']} -> {r['output']}: the {r['model']} model as a {r['format']}",
        f"  tables          {r['tables']} ({r['embedding_rows']:,} rows of {r['embedding_dim']})",
        f"  vocabulary      {'included (vocabulary.json)' if r['vocabulary'] else 'none: the dataset keeps none'}",
        f"  files           {files} ({r['bytes'] / 2**20:.1f} MiB)",
        f"  state SHA-256   {r['state_sha256'][:16]}... (checked)",
        f"  time            {r['seconds']:.1f} s",
    ])
