"""dlrmflow verify: recompute a finished run's parity from its embedding rows, compare bit for bit.

Exit status: 0 when the parity matches; 1 when it does not (a failed verification: the summary, or
the JSON object, on stdout as usual, and one line on stderr saying so); 2 for a bad RUN_DIR.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

NAME = "verify"
HELP = ("check a run trained with --parity: parity re-encoded from final_state.pt equals its parity shards "
        "(exit status 1 when it does not)")
MISMATCH_EXIT_STATUS = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the --output directory of a `dlrmflow train --parity` run")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from dlrmflow.flows.recovery import verify_flow

    result = verify_flow(args.run_dir)
    if not result["ok"]:
        # The CLI exits 0 after any result it prints; a mismatch prints the same, then exits 1.
        print(json.dumps(result, sort_keys=True) if getattr(args, "json", False) else summarize(result))
        print(f"dlrmflow {NAME}: parity of {result['run_dir']} does not match its data "
              f"({sum(result['mismatched_stripes']):,} mismatched stripes)", file=sys.stderr)
        raise SystemExit(MISMATCH_EXIT_STATUS)
    return result


def summarize(r: dict[str, Any]) -> str:
    status = "OK: parity matches the data bit for bit" if r["ok"] else (
        f"MISMATCH: stripes differ per parity shard {r['mismatched_stripes']} (first: {r['first_mismatches']})")
    return f"verify {r['run_dir']} (k={r['k']}, r={r['r']}, {r['stripes']:,} stripes): {status}"
