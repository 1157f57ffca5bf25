"""dlrmflow train: train a CTR model locally, against embedding servers, or with an LRU / oracle cache."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from dlrmflow.commands import options
from dlrmflow.commands.units import size
from dlrmflow.engine.errors import UserInputError
from dlrmflow.engine.training.faults import KILL_METAVAR

NAME = "train"
HELP = ("train a CTR model (DLRM, Wide & Deep, DeepFM, DCN-v2) in mode local, remote, lru or oracle; writes "
        "final_state/ (one file per embedding server) and summary.json")
FLOWS = ("dlrmflow.flows.train", "torch._inductor.config", "matplotlib.pyplot")  # cli.import_flows


# Metavars of the options whose value is not a plain word (the option names: TrainConfig.cli_option).
METAVARS = {"dataset_dir": "DATASET_DIR", "output_dir": "RUN_DIR", "plan_dir": "PLAN_DIR", "capacity": "ROWS",
            "num_shards": "K", "trainers": "W", "iterations": "N", "batch_size": "B", "bottom_mlp": "SIZES",
            "top_mlp": "SIZES", "dnn": "SIZES", "cross_layers": "L", "eval_fraction": "F", "metrics_every": "N",
            "eval_every": "N", "lr_num_warmup_steps": "N", "lr_decay_start_step": "ITER", "lr_num_decay_steps": "N",
            "parity": "R", "kills": KILL_METAVAR,
            "rebuild_chunk": "STRIPES", "rebuild_rate": "MB/S", "parity_batches": "N", "checkpoint_every": "N",
            "init_from": "RUN_DIR"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One option per TrainConfig field that the CLI sets (its name: ``cli_option``), with the field's
    type, choices, default and description."""
    from dlrmflow.cli import add_dask_argument
    from dlrmflow.engine.training.config import TrainConfig

    options.add_config_options(parser, TrainConfig, METAVARS)
    add_dask_argument(parser)


def config_from_args(args: argparse.Namespace):
    """The TrainConfig the options say (TrainConfigError names a bad field)."""
    from dlrmflow.engine.training.config import TrainConfig

    return options.checked_config(args, TrainConfig)


def starts_local_cluster(args: argparse.Namespace) -> bool:
    """Whether the run starts a LocalCluster (without a Dask address): a mode with embedding servers. ``args``: the
    options, or a TrainConfig (resume's)."""
    from dlrmflow.engine.training.modes import MODES

    return MODES[args.mode].servers


def trains_on_cluster(args: argparse.Namespace) -> bool:
    """Whether trainers run on the cluster's workers (``--trainers`` 2 or more)."""
    return args.trainers > 1


def workers_use_torch(args: argparse.Namespace) -> bool:
    """Whether the workers' server imports torch for them: where trainers run there. The embedding servers, their
    parity and rebuilds import none; a worker that scores a large held-out set (at least
    ``cluster_scoring.CLUSTER_MIN_ROWS`` rows, on a worker no member holds) imports it then, once."""
    return trains_on_cluster(args)


def check(args: argparse.Namespace) -> None:
    """The options' checks, before Prefect, torch or Dask load (TrainConfig is a light module); with
    --init-from, that the directory holds a finished run (the rest is checked against the dataset later)."""
    from dlrmflow.datasets.meta import read_meta
    from dlrmflow.engine.training.continuation import parent_cardinalities, read_finished_run

    config = config_from_args(args)
    if config.init_from is not None:
        run = read_finished_run(config.init_from)
        parent_cardinalities(run, read_meta(config.dataset_dir), f"--init-from {config.init_from}")


class TrainingStopped(UserInputError):
    """Training failed after a checkpoint: one line with the cause and the command that resumes the run."""


def run_training(config, dask_address: str | None) -> dict[str, Any]:
    """Run the train flow on ``config``; its first task checks every input. A run refused for its input
    prints one line (the flow's console lines are held until the check passed: :class:`HeldConsole`); a
    failure after the check that leaves a resumable run names `dlrmflow resume RUN_DIR`."""
    from dlrmflow.commands.console import HeldConsole
    from dlrmflow.engine.training.run_directory import ResumeError, resume_command
    from dlrmflow.engine.training.run_directory_checks import refuse_to_overwrite, unfinished_run_message
    from dlrmflow.flows.train import INPUT_CHECKED, train_flow

    if not config.resume:
        refuse_to_overwrite(config.output_dir)  # never over a finished run or a directory that is not a run's
    console = HeldConsole(INPUT_CHECKED)
    try:
        with console:
            summary = train_flow(config, dask_address)
    except ResumeError:
        raise
    except Exception as exc:
        message = unfinished_run_message(config.output_dir) if console.checked else None
        if message is None:  # refused for its input, or nothing to resume
            raise
        if resume_command(config.output_dir) in str(exc):  # the cause says how to resume already: not twice
            raise TrainingStopped(f"training stopped ({type(exc).__name__}: {exc})") from exc
        raise TrainingStopped(f"training stopped ({type(exc).__name__}: {exc}); {message}") from exc
    except KeyboardInterrupt:
        message = unfinished_run_message(config.output_dir)
        if message:
            print(message, file=sys.stderr)
        raise
    summary.pop("metrics", None)  # in summary.json and the Prefect table; keep the JSON line short
    return summary


def run(args: argparse.Namespace) -> dict[str, Any]:
    return run_training(config_from_args(args), args.dask_address)


def _parity_lines(p: dict[str, Any] | None) -> list[str]:
    if not p:
        return []
    verify = p["verify"]
    lines = [
        f"  parity             R={p['parity_shards']}: {size(p['parity_bytes_sent'])} of deltas in "
        f"{p['write_back_batches']:,} write-back batches; verify "
        f"{'OK' if verify['ok'] else 'FAILED ' + str(verify['mismatched_stripes'])} ({verify['stripes']:,} stripes)",
    ]
    for kill in p["kills"]:
        lines.append(f"  killed             {kill['kill']} (pid {kill['pid']}) at {kill['at_s']:.3f} s")
    from dlrmflow.engine.coding.record import noticed_words, recovery_sentence

    for rec in p["recoveries"]:  # the figures of the run's log and its recover-shard run (engine.coding.record)
        lines.append(f"  recovered          {recovery_sentence(rec).removeprefix('rebuilt ')}")
        noticed = noticed_words(rec)
        after = _noticed(p["kills"], rec["detected_s"]).removeprefix(" (noticed").removesuffix(")")
        if noticed or after:  # what showed the loss (a restart of the rebuild adds one), how long after the kill
            lines.append(f"{'':21}noticed{after}{' by ' if noticed else ''}{'; then by '.join(noticed)}")
        lines.append(f"{'':21}bulk copy {rec['copy_seconds']:.3f} s: {rec['copy_task_seconds']:.3f} s in copy "
                     f"tasks on the new shards' worker ({rec['copy_read_wait_seconds']:.3f} s waiting for "
                     f"survivors, {rec['copy_install_seconds']:.3f} s decoding and installing); "
                     f"{p['degraded_rows_read']:,} degraded row reads")
    return lines


def _noticed(kills: list[dict[str, Any]], detected_s: float) -> str:
    """How long the latest kill before a detection went unnoticed (a real failure has no kill record)."""
    before = [k["at_s"] for k in kills if k["at_s"] <= detected_s]
    return f" (noticed {detected_s - max(before):.3f} s after the kill)" if before else ""


def _checkpoint_lines(c: dict[str, Any] | None) -> list[str]:
    if not c:
        return []
    lines = [f"  checkpoints        {len(c['checkpoints'])} (every {c['every']} iterations), "
             f"{sum(x['seconds'] for x in c['checkpoints']):.3f} s writing {c['file']}"]
    if c.get("resumed_from") is not None:
        lines.append(f"  resumed            from the checkpoint at iteration {c['resumed_from']}")
    for rec in c["recoveries"]:
        lines.append(f"  recovered          reloaded iteration {rec['replay_from']}, replayed to {rec['failed_at']}: "
                     f"{rec['seconds']:.3f} s after detection{_noticed(c.get('kills', []), rec['detected_s'])}")
    return lines


def _trainer_lines(trainers: dict[str, Any] | None) -> list[str]:
    """With several trainers: what went between them, by kind, and the time spent syncing."""
    if not trainers:
        return []
    between = trainers["bytes_between_trainers"]
    kinds = ", ".join(f"{size(count)} {kind}" for kind, count in sorted(between.items()))
    return [f"  trainers           {trainers['count']}: {kinds or 'nothing'} between them; "
            f"{100 * trainers['sync_fraction']:.1f}% of iteration time syncing rows"]


def _timing_lines(r: dict[str, Any]) -> list[str]:
    """Start-up (launch to the first iteration) and finish (last iteration to summary.json), by phase."""
    startup = "" if r.get("startup_seconds") is None else f"start-up {r['startup_seconds']:.1f} s (launch to the " \
        "first iteration); "
    phases = ", ".join(f"{phase.replace('_', ' ')} {seconds:.1f} s" for phase, seconds in r["finish"].items())
    return [f"  outside iterations {startup}finish {r['finish_seconds']:.1f} s ({phases})"]


def _evaluation_lines(r: dict[str, Any]) -> list[str]:
    """With --eval-every: how many evaluations, and the best one (without it, the final one only: nothing)."""
    evaluations = r["evaluations"]
    if len(evaluations) < 2:
        return []
    best = next(e for e in evaluations if e["iteration"] == r["best_evaluation_iteration"])
    auc = "n/a" if best["auc"] is None else f"{best['auc']:.4f}"
    return [f"  evaluations        {len(evaluations)} (every {r['eval_every']} iterations); best at iteration "
            f"{best['iteration']:,}: AUC {auc}, log loss {best['logloss']:.4f}"]


def summarize(r: dict[str, Any]) -> str:
    auc = "n/a" if r["eval_auc"] is None else f"{r['eval_auc']:.4f}"
    logloss = "n/a" if r["eval_log_loss"] is None else f"{r['eval_log_loss']:.4f}"
    lines = [
        f"{r['mode']} training{'' if r['model'] == 'dlrm' else ' of ' + r['model']}"
        f"{' with ' + str(r['trainers']['count']) + ' trainers' if r.get('trainers') else ''}: "
        f"{r['iterations']:,} iterations of batch {r['batch_size']:,} on {r['device']}",
        f"  mean iteration     {r['mean_iteration_ms']:.2f} ms (median {r['median_iteration_ms']:.2f} ms)",
        f"  stall              {100 * r['stall_fraction']:.1f}% of iteration time",
        f"  traffic            {size(r['bytes_fetched'])} fetched, "
        f"{size(r['bytes_written_back'])} written back",
        *_trainer_lines(r.get("trainers")),
        f"  train loss         {r['first_train_loss']:.4f} (first) -> {r['final_train_loss_mean']:.4f} "
        f"(mean of the last {min(r['metrics_every'], r['iterations'])})",
        f"  eval ({r['eval_rows']:,} rows)   AUC {auc}, log loss {logloss}",
        *_evaluation_lines(r),
        f"  state SHA-256      {r['state_sha256']}",
        *_parity_lines(r.get("parity")),
        *_checkpoint_lines(r.get("checkpoint")),
        *_timing_lines(r),
        f"  output             {r['output_dir']}/ (final_state/, summary.json, iterations.csv)",
    ]
    return "\n".join(lines)
