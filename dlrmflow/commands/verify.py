"""dlrmflow verify: recompute a finished run's parity from its embedding rows, compare bit for bit.

Exit status: 0 when the parity matches; 1 when it does not (a failed verification: the summary, or
the JSON object, on stdout as usual, and one line on stderr saying so); 2 for a bad RUN_DIR.
"""

from __future__ import annotations

import argparse
from typing import Any

NAME = "verify"
HELP = ("check a run trained with --parity: parity re-encoded from final_state.pt equals its parity shards "
        "(exit status 1 when it does not)")
MISMATCH_EXIT_STATUS = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the --output directory of a `dlrmflow train --parity` run")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from dlrmflow.flows.recovery import verify_flow

    return verify_flow(args.run_dir)


def failure(r: dict[str, Any]) -> tuple[int, str] | None:
    """A mismatch is a failed verification: exit status 1 and one line, after the usual output."""
    if r["ok"]:
        return None
    return MISMATCH_EXIT_STATUS, (f"parity of {r['run_dir']} does not match its data "
                                  f"({sum(r['mismatched_stripes']):,} mismatched stripes)")


def summarize(r: dict[str, Any]) -> str:
    status = "OK: parity matches the data bit for bit" if r["ok"] else (
        f"MISMATCH: stripes differ per parity shard {r['mismatched_stripes']} (first: {r['first_mismatches']})")
    return f"verify {r['run_dir']} (k={r['k']}, r={r['r']}, {r['stripes']:,} stripes): {status}"
