"""A typed view of a training run's summary, for the code that reads it (the pipeline, the train report).

:func:`~dlrmflow.engine.training.job.train` returns its summary as a dict, the object ``summary.json``
records and ``dlrmflow train --json`` prints. :func:`train_summary` makes the :class:`TrainSummary` of the
fields the pipeline and the train flow read; the train report's summary table, the daily flow,
``--init-from`` and ``dlrmflow train``'s own report read the dict's keys themselves.
:func:`saved_run` is the training run's "up to date" rule (:mod:`dlrmflow.engine.up_to_date`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlrmflow.engine.run_state import SUMMARY_FILE
from dlrmflow.engine.training.config import TrainConfig
from dlrmflow.engine.training.modes import MODES
from dlrmflow.engine.up_to_date import saved_result


@dataclass(frozen=True)
class TrainSummary:
    """What a finished training run measured (the fields its readers use; summary.json holds more)."""

    mode: str
    dataset: str
    output_dir: str
    iterations: int
    batch_size: int
    num_shards: int  # 0 without embedding servers
    capacity: int | None  # cache rows (lru: --capacity; oracle: the plan's slots)
    mean_iteration_ms: float
    median_iteration_ms: float
    stall_fraction: float
    bytes_fetched: int
    bytes_written_back: int
    final_train_loss: float
    final_train_loss_mean: float  # mean over the last metrics_every iterations
    eval_auc: float | None
    eval_log_loss: float | None
    state_sha256: str
    metrics_every: int
    metrics: list[dict[str, Any]] = field(default_factory=list)  # per window of metrics_every iterations
    # held-out {iteration, auc, logloss}: every eval_every iterations and at the end; the best's iteration
    evaluations: list[dict[str, Any]] = field(default_factory=list)
    best_evaluation_iteration: int | None = None
    parity: dict[str, Any] | None = None  # the parity report (shards, kills, recoveries, verify)
    trainers: int = 1  # data-parallel trainer processes
    skipped: bool = False  # an earlier run's summary, reused because the run is up to date

    @property
    def parity_shards(self) -> int:
        return int((self.parity or {}).get("parity_shards") or 0)

    @property
    def kills(self) -> list[dict[str, Any]]:
        """The kills the run made (``kill``: ``shard:I@ITER``, ``at_s``); none without parity."""
        return list((self.parity or {}).get("kills", []))


def train_summary(summary: Mapping[str, Any], *, skipped: bool = False) -> TrainSummary:
    """The typed view of the engine's summary dict, or of a summary.json (``parity`` is there only with
    --parity, ``trainers`` only with more than one)."""
    return TrainSummary(
        mode=summary["mode"], dataset=str(summary["dataset"]), output_dir=str(summary["output_dir"]),
        iterations=summary["iterations"], batch_size=summary["batch_size"], num_shards=summary["num_shards"],
        capacity=summary["capacity"], mean_iteration_ms=summary["mean_iteration_ms"],
        median_iteration_ms=summary["median_iteration_ms"], stall_fraction=summary["stall_fraction"],
        bytes_fetched=summary["bytes_fetched"], bytes_written_back=summary["bytes_written_back"],
        final_train_loss=summary["final_train_loss"], final_train_loss_mean=summary["final_train_loss_mean"],
        eval_auc=summary["eval_auc"], eval_log_loss=summary["eval_log_loss"],
        state_sha256=summary["state_sha256"], metrics_every=summary["metrics_every"],
        metrics=list(summary["metrics"]), evaluations=list(summary["evaluations"]),
        best_evaluation_iteration=summary["best_evaluation_iteration"], parity=summary.get("parity"),
        trainers=summary["trainers"]["count"] if "trainers" in summary else 1, skipped=skipped,
    )


def saved_run(config: TrainConfig, dataset_fingerprint: str) -> TrainSummary | None:
    """The summary of the finished run in ``config.output_dir`` when it is up to date: it trained the dataset
    of ``dataset_fingerprint`` with this config's mode, model, iterations, batch size, seed, shards, trainers,
    learning-rate schedule, evaluations and (with or without) parity. A run with kills is never up to date
    (its kills are what it is for)."""
    if config.kills:
        return None
    expect = {"dataset_fingerprint": dataset_fingerprint, "mode": config.mode, "iterations": config.iterations,
              "batch_size": config.batch_size, "seed": config.seed, "model": config.model,
              "num_shards": config.num_shards if MODES[config.mode].servers else 0,
              "lr_schedule": {"warmup_steps": config.lr_num_warmup_steps,
                              "decay_start_step": config.lr_decay_start_step,
                              "decay_steps": config.lr_num_decay_steps},
              "eval_every": config.eval_every}
    earlier = saved_result(Path(config.output_dir) / SUMMARY_FILE, expect)
    if earlier is None:
        return None
    run = train_summary(earlier, skipped=True)
    if bool(run.parity) != bool(config.parity) or run.trainers != config.trainers:
        return None
    return run

