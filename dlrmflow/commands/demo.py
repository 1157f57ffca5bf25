"""dlrmflow demo: the whole pipeline on the embedded default (what `make run` runs)."""

from __future__ import annotations

import argparse
from typing import Any

from dlrmflow.commands import starts_local_cluster  # noqa: F401  (cli: the flow always starts a LocalCluster)

NAME = "demo"
HELP = "run the whole pipeline: generate, preprocess, profile, plan, compare caches, train (LocalCluster)"
FLOWS = ("dlrmflow.flows.pipeline", "torch._inductor.config", "matplotlib.pyplot")  # cli.import_flows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from dlrmflow.cli import add_dask_argument
    from dlrmflow.engine.training.faults import KILL_METAVAR
    from dlrmflow.flows.pipeline_config import PipelineConfig

    fields = PipelineConfig.model_fields
    for name in ("work_dir", "rows", "scale", "seed", "batch_size", "lookahead", "prefetch_distance",
                 "train_iterations", "model", "shards", "trainers", "parity", "link_rate"):
        field = fields[name]
        kind = type(field.default)
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=field.default,
                            help=f"{field.description or name} (default {field.default})")
    parser.add_argument("--kill", action="append", default=[], metavar=KILL_METAVAR,
                        help=fields["kills"].description)
    add_dask_argument(parser)


def config_from_args(args: argparse.Namespace):
    """The pipeline's config; a bad value raises PipelineConfigError (a UserInputError) naming the field."""
    from dlrmflow.flows.pipeline_config import PipelineConfig

    values = {name: getattr(args, name) for name in PipelineConfig.model_fields if hasattr(args, name)}
    values["kills"] = args.kill
    return PipelineConfig(**values)


def check(args: argparse.Namespace) -> None:
    """The options' checks, before Prefect, torch or Dask load (the pipeline's config is a light module)."""
    args.config = config_from_args(args)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from dlrmflow.flows.pipeline import pipeline_flow

    return pipeline_flow(getattr(args, "config", None) or config_from_args(args))


def summarize(r: dict[str, Any]) -> str:
    from dlrmflow.commands.units import size

    g, p = r["generated"], r["preprocess"]

    def took(step: dict[str, Any] | None) -> str:
        if not step:
            return ""
        return "skipped (up to date)" if step.get("skipped") else f"{step.get('seconds', 0):.1f} s"

    lines = [f"dlrmflow pipeline finished: {r['work_dir']}", ""]
    if g:
        lines.append(f"  generate    {g['rows']:,} rows, {size(g['bytes'])}  {took(g)}")
    lines.append(f"  preprocess  {p['rows']:,} rows, {p['rejected_rows']} rejected, "
                 f"{p['embedding_rows']:,} embedding rows  {took(p)}")
    plan = r["plan"]
    lines.append(f"  plan        {plan['num_iterations']:,} iterations, {plan['counts']['prefetched_rows']:,} "
                 f"prefetches  {'skipped (up to date)' if plan.get('skipped') else ''}")
    lines.append("")
    width = max(len(row["what"]) for row in r["summary"])
    lines.append(f"  {'':<{width}}  {'dlrmflow':>14}  {'baseline':>14}  ratio")
    for row in r["summary"]:
        lines.append(f"  {row['what']:<{width}}  {row['value']:>14}  {row['baseline']:>14}  {row['ratio']}")
    lines += ["", f"plots: {r['work_dir']}/dataset/coverage.png, {r['work_dir']}/caches/"]
    return "\n".join(lines)
