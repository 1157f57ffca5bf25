"""Prefect tasks of the train flow (thin wrappers over :mod:`dlrmflow.engine.training.job`) and its report."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.cache_policies import NO_CACHE

from dlrmflow.engine.coding.record import recovery_figures
from dlrmflow.engine.serving.cluster import dask_client
from dlrmflow.engine.training.config import TrainConfig
from dlrmflow.engine.training.faults import parse_kill
from dlrmflow.engine.training.job import train
from dlrmflow.engine.training.modes import MODES
from dlrmflow.engine.training.run_setup import RunSetup, prepare_run
from dlrmflow.engine.training.summary import TrainSummary, train_summary
from dlrmflow.tasks import plots, task
from dlrmflow.tasks.reporting import (
    Column,
    FlowProgress,
    artifact_key,
    dataset_label,
    engine_events_to_run_log,
    format_table,
    metric_table,
    publish_plot,
    publish_table,
    train_run_label,
)

# (what, summary key, unit) of the train-summary table.
SUMMARY_ITEMS = [
    ("Mode", "mode", ""), ("Iterations", "iterations", "count"), ("Batch size", "batch_size", "count"),
    ("Shards", "num_shards", "count"), ("Cache rows", "capacity", "count"),
    ("Mean iteration time", "mean_iteration_ms", "ms"), ("Median iteration time", "median_iteration_ms", "ms"),
    ("Stalled (share of iteration time)", "stall_fraction", "%"), ("Fetched", "bytes_fetched", "MB"),
    ("Written back", "bytes_written_back", "MB"), ("Final train loss (mean)", "final_train_loss_mean", ""),
    ("Eval AUC", "eval_auc", ""), ("Eval log loss", "eval_log_loss", ""),
    ("Best evaluation (lowest log loss), after iterations", "best_evaluation_iteration", "count"),
    ("State SHA-256", "state_sha256", ""),
]
PARITY_ITEMS = [
    ("Parity shards", "parity_shards", "count"), ("Write-back batches", "write_back_batches", "count"),
    ("Parity sent", "parity_bytes_sent", "MB"), ("Degraded rows read", "degraded_rows_read", "count"),
]
# Iterations count from 0, as in iterations.csv, the plots and a kill's ``shard:I@ITER``: a metrics row covers
# iterations ``lo..hi`` (the engine's row says how many were done: ``hi + 1``); an evaluation is made after
# ``iteration`` iterations were done, at the start of iteration ``iteration``.
METRICS_COLUMNS = [Column("Iterations", "iterations"), Column("Training loss", "loss"),
                   Column("Iteration time", "iteration_ms", "ms"), Column("Stalled", "stall_ms", "ms")]
EVALUATION_COLUMNS = [Column("After iterations", "iteration", "count"), Column("Held-out AUC", "auc"),
                      Column("Held-out log loss", "logloss")]


def iteration_span(row: dict[str, Any], every: int) -> tuple[int, int]:
    """The iterations (from 0) of an engine metrics row: those since the previous row, due every ``every``
    iterations and after the last (``{"iteration": 6}`` with every 50: iterations 0..5)."""
    done = int(row["iteration"])
    return (done - 1) // every * every, done - 1


def iterations_text(row: dict[str, Any], every: int) -> str:
    """``iteration 2`` or ``iterations 0–49``: the iterations a metrics row's means are over."""
    lo, hi = iteration_span(row, every)
    return f"iteration {hi:,}" if lo == hi else f"iterations {lo:,}–{hi:,}"


def metrics_rows(run: TrainSummary) -> list[dict[str, Any]]:
    """The train-metrics table's rows: each engine row with the span of iterations (from 0) it covers."""
    return [{**row, "iterations": iterations_text(row, run.metrics_every).removeprefix("iterations ")
             .removeprefix("iteration ")} for row in run.metrics]


def metrics_description(run: TrainSummary) -> str:
    """What the train-metrics table's rows are: means over windows of ``metrics_every`` iterations, or over
    the whole run when it is not longer than one window."""
    if run.iterations <= run.metrics_every:
        return f"training loss and iteration time, means over the run's {run.iterations:,} iterations"
    if run.metrics_every == 1:
        return "training loss and iteration time of each iteration (iterations count from 0)"
    return (f"training loss and iteration time, means over each {run.metrics_every:,} iterations "
            f"(iterations count from 0)")


def train_artifact_key(base: str, run: TrainSummary) -> str:
    """``base-<mode>[-k<K>-r<R>]-<run dir label>`` (``train-summary-oracle-k2-r1-demo-oracle-parity1-3f9a0c``): the
    run directory identifies the run, so a key's history is that run's, night after night, and a run in
    another directory never becomes the newest version of this one's keys."""
    return artifact_key(base, train_run_label(run.mode, run.num_shards, run.parity_shards, run.output_dir))


# A RunSetup holds the plan and the dataset's stream: hashing it for a cache key would cost a pass
# over the plan, and a training run is never a cache hit.
@task(name="check-train-config", cache_policy=NO_CACHE)
def check_task(config: TrainConfig) -> RunSetup:
    """Every input check before any work (dataset, plan, capacity, iterations, the run dir's checkpoint): the
    train flow's first task. Its result, the checked run, is the train task's input."""
    return prepare_run(config)


@task(name="train-dlrm", cache_policy=NO_CACHE)
def train_task(setup: RunSetup, dask_address: str | None, recovery_runner: Callable | None = None) -> dict[str, Any]:
    """Train the checked run ``setup``; with parity, ``recovery_runner`` reports each shard rebuild.

    The engine's events (a kill, a lost shard, a rebuild) go to this run's log as they happen."""
    config = setup.config
    logger = get_run_logger()
    progress = FlowProgress(f"{config.mode} training iterations")

    def on_metrics(row: dict[str, Any]) -> None:
        logger.info("%s: loss %.4f, %.2f ms/iteration, stall %.2f ms", iterations_text(row, config.metrics_every),
                    row["loss"], row["iteration_ms"], row["stall_ms"])

    with engine_events_to_run_log(logger):
        if not MODES[config.mode].servers:
            summary = train(config, setup=setup, progress=progress, on_metrics=on_metrics)
        else:
            with dask_client(dask_address) as client:
                summary = train(config, setup=setup, client=client, progress=progress, on_metrics=on_metrics,
                                recovery_runner=recovery_runner)
    progress.finish()
    return summary


def _summary_items(summary: dict[str, Any]) -> list[tuple[str, Any, str]]:
    """The summary's figures of :data:`SUMMARY_ITEMS`: a row only for a figure with a value, or one that says why
    there is none (a mode without a cache; no rows held out: one row for the evaluation's three)."""
    items = []
    held_out = bool(summary.get("eval_rows")) or summary.get("eval_auc") is not None
    for what, key, unit in SUMMARY_ITEMS:
        value = summary.get(key)
        if key == "capacity" and value is None:
            mode = summary.get("mode", "")
            if mode in MODES and not MODES[mode].capacity:
                items.append((what, f"none: {mode} mode has no cache", ""))
        elif key in ("eval_auc", "eval_log_loss", "best_evaluation_iteration") and not held_out:
            if key == "eval_auc":
                items.append(("Held-out evaluation", "none: no rows held out (eval fraction 0)", ""))
        elif key == "eval_auc" and value is None:
            items.append((what, "undefined: the held-out rows have one class only", ""))
        elif value is not None:
            items.append((what, value, unit))
    return items


def summary_table(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The train-summary table: one row per figure; with parity, its figures, the kills and each recovery (the
    brief form of :func:`~dlrmflow.engine.coding.record.recovery_figures`, which its recover-shard run shows
    in full). No row is blank: a figure without a value is left out or says why."""
    items = _summary_items(summary)
    parity = summary.get("parity")
    if parity:
        items += [(what, parity.get(key), unit) for what, key, unit in PARITY_ITEMS if parity.get(key) is not None]
        verify = parity.get("verify") or {}
        items.append(("Parity verified", "OK" if verify.get("ok") else
                      f"MISMATCH in stripes {verify.get('mismatched_stripes')}", ""))
        for record in parity.get("kills", []):
            kill = parse_kill(record["kill"])
            items.append((f"Killed {kill.target} (iteration {kill.iteration}), after the shards started",
                          record.get("at_s"), "s"))
        for n, record in enumerate(parity.get("recoveries", []), start=1):
            items += [(f"Recovery {n}: {what}", value, unit)
                      for what, value, unit in recovery_figures(record, brief=True)]
    return metric_table(items)


@task(name="publish-train-report")
def publish_train_report_task(summary: dict[str, Any]) -> list[str]:
    """The run's tables (summary, loss and time every ``metrics_every`` iterations) and plots
    (loss curve, iteration time with stalls); the plots are also written to the run directory. Returns the keys."""
    run = train_summary(summary)
    what = f"{run.mode} training of {dataset_label(run.dataset)}"
    keys = [
        publish_table(train_artifact_key("train-summary", run), summary_table(summary), f"{what}: run summary"),
        publish_table(train_artifact_key("train-metrics", run), format_table(metrics_rows(run), METRICS_COLUMNS),
                      f"{what}: {metrics_description(run)}"),
    ]
    if len(run.evaluations) > 1:  # --eval-every: the held-out metrics as training went
        keys.append(publish_table(train_artifact_key("train-evaluations", run),
                                  format_table(run.evaluations, EVALUATION_COLUMNS),
                                  f"{what}: held-out AUC and log loss (best after "
                                  f"{run.best_evaluation_iteration:,} iterations)"))
    out = Path(run.output_dir)
    log = out / "iterations.csv"
    if log.is_file():
        columns = plots.read_iterations(log)
        loss = plots.plot_loss(columns, out / plots.LOSS_PLOT, title=f"Training loss, {what}", kills=run.kills,
                               evaluations=run.evaluations)
        time_png = plots.plot_iteration_time(columns, out / plots.TIME_PLOT, title=f"Iteration time, {what}",
                                             kills=run.kills)
        keys.append(publish_plot(train_artifact_key("train-loss", run), loss, f"{what}: training loss"))
        keys.append(publish_plot(train_artifact_key("train-time", run), time_png,
                                 f"{what}: iteration time and stalls"))
    return keys
