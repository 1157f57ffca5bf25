"""dlrmflow verify: recompute a finished run's parity from its embedding rows, compare bit for bit.

The rows and the parity are read a chunk of stripes at a time from the files each server wrote
(``final_state/``); on the same pass every file's SHA-256 is checked against the manifest and the
state SHA-256 recomputed.

Exit status: 0 when the parity matches; 1 when it does not (a failed verification: the summary, or
the JSON object, on stdout as usual, and one line on stderr saying so); 2 for a bad RUN_DIR.
"""

from __future__ import annotations

import argparse
from typing import Any

NAME = "verify"
HELP = ("check a run trained with --parity: parity re-encoded from its final state equals its parity shards, "
        "and its files their manifest (exit status 1 when not)")
FLOWS = ("dlrmflow.flows.recovery",)  # cli.import_flows
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
    if not r["parity_ok"]:
        return MISMATCH_EXIT_STATUS, (f"parity of {r['run_dir']} does not match its data "
                                      f"({sum(r['mismatched_stripes']):,} mismatched stripes)")
    return MISMATCH_EXIT_STATUS, (f"the files of {r['run_dir']} do not match its manifest "
                                  f"({', '.join(r['damaged_files']) or 'the state SHA-256 differs'})")


def summarize(r: dict[str, Any]) -> str:
    status = "OK: parity matches the data bit for bit" if r["parity_ok"] else (
        f"MISMATCH: stripes differ per parity shard {r['mismatched_stripes']} (first: {r['first_mismatches']})")
    status += ("; every file matches its manifest" if r["files_ok"] else
               f"; DAMAGED: {', '.join(r['damaged_files'])} differ from the manifest")
    status += "" if r["state_sha256_ok"] else f"; the state SHA-256 is now {r['state_sha256']}"
    return f"verify {r['run_dir']} (k={r['k']}, r={r['r']}, {r['stripes']:,} stripes): {status}"
