"""dlrmflow verify: recompute a finished run's parity from its embedding rows, compare bit for bit."""

from __future__ import annotations

import argparse
from typing import Any

NAME = "verify"
HELP = "check a run trained with --parity: parity re-encoded from final_state.pt equals its parity shards"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the --output directory of a `dlrmflow train --parity` run")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from dlrmflow.flows.recovery import verify_flow

    return verify_flow(args.run_dir)


def summarize(r: dict[str, Any]) -> str:
    status = "OK: parity matches the data bit for bit" if r["ok"] else (
        f"MISMATCH: stripes differ per parity shard {r['mismatched_stripes']} (first: {r['first_mismatches']})")
    return f"verify {r['run_dir']} (k={r['k']}, r={r['r']}, {r['stripes']:,} stripes): {status}"
