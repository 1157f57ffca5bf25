"""dlrmflow demo: the main job on the embedded default (what `make run` runs)."""

from __future__ import annotations

import argparse
from typing import Any

NAME = "demo"
HELP = "run the whole pipeline on generated data (LocalCluster, local Prefect API)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from dlrmflow.cli import add_dask_argument
    from dlrmflow.flows.pipeline import DEMO_ROWS, DEMO_SCALE

    parser.add_argument("--work-dir", default="runs/demo", help="where data and results go (default runs/demo)")
    parser.add_argument("--rows", type=int, default=DEMO_ROWS, help=f"rows to generate (default {DEMO_ROWS:,})")
    parser.add_argument("--scale", type=float, default=DEMO_SCALE,
                        help=f"table size scale vs Criteo Kaggle (default {DEMO_SCALE})")
    parser.add_argument("--seed", type=int, default=0)
    add_dask_argument(parser)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from dlrmflow.errors import UserInputError
    from dlrmflow.flows.pipeline import pipeline_flow

    if args.rows < 1 or args.scale <= 0:
        raise UserInputError("--rows must be >= 1 and --scale > 0")
    result = pipeline_flow(work_dir=args.work_dir, rows=args.rows, scale=args.scale, seed=args.seed,
                           dask_address=args.dask_address)
    result["profile"].pop("coverage", None)
    return result


def summarize(r: dict[str, Any]) -> str:
    g, p, s = r["generated"], r["preprocess"], r["profile"]
    def done(step: dict[str, Any]) -> str:
        return "skipped (up to date)" if step.get("skipped") else f"{step['seconds']:.1f} s"
    rows = [
        ("generate", f"{g['rows']:,} rows, {g['bytes'] / 1e6:,.0f} MB", done(g)) if g else None,
        ("preprocess", f"{p['rows']:,} rows, {p['rejected_rows']} rejected, {p['embedding_rows']:,} embedding rows",
         done(p)),
        ("profile", f"top 1% of rows take {100 * s['top1pct_share']:.1f}% of accesses", ""),
    ]
    lines = [f"dlrmflow demo finished: {r['work_dir']}", ""]
    lines += [f"  {a:<11} {b:<60} {c}" for a, b, c in filter(None, rows)]
    lines += ["", f"dataset: {p['dataset']}   skew plot: {s['plot']}"]
    return "\n".join(lines)
