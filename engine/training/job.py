"""Run one training job: check it (:mod:`.run_setup`), run its trainers (:mod:`.trainer`; one in this process, or
W on Dask workers, :mod:`.launch`), write what it produced.

Every mode ends in bit-identical parameters: the one-trainer reference is ``local`` (all rows in the
trainer's memory), the W-trainer reference ``remote`` with the same W (docs/trainers.md). The modes
are declared in :mod:`.modes`; the loop that all of them run is :mod:`.loop`.

Data: training runs the first ``iterations`` batches of ``BatchStream(dataset, batch_size)`` (the stream
a plan is made for); the last ``eval_fraction`` of the dataset's rows are held out for AUC and log loss
and must not overlap the training batches. Deterministic algorithms are switched on for the run.
"""

from __future__ import annotations

import contextlib
import csv
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dlrmflow.engine.coding.group import RecoveryRunner
from dlrmflow.engine.models import architecture
from dlrmflow.engine.run_lock import output_lock
from dlrmflow.engine.run_state import ITERATIONS_FILE, commit_state_dir, write_summary
from dlrmflow.engine.serving.placement import host_of
from dlrmflow.engine.training.config import TrainConfig
from dlrmflow.engine.training.continuation import init_from_record
from dlrmflow.engine.training.evaluation import best_evaluation, evaluation_row
from dlrmflow.engine.training.launch import run_trainers
from dlrmflow.engine.training.modes import MODES
from dlrmflow.engine.training.run_context import MetricsCallback, Progress, RunContext
from dlrmflow.engine.training.run_directory import finish_run_dir, start_run_dir
from dlrmflow.engine.training.run_directory_checks import unfinished_run_message
from dlrmflow.engine.training.run_setup import RunSetup, prepare_run
from dlrmflow.engine.training.stores.oracle import spare_slots
from dlrmflow.engine.training.timing import run_timing

if TYPE_CHECKING:
    from distributed import Client


def train(
    config: TrainConfig,
    *,
    client: Client | None = None,
    progress: Progress | None = None,
    on_metrics: MetricsCallback | None = None,
    setup: RunSetup | None = None,
    recovery_runner: RecoveryRunner | None = None,
) -> dict[str, Any]:
    """Run one training job; write final_state/, summary.json and iterations.csv; return the summary.

    With ``parity``: ``recovery_runner(rebuild, info)`` runs each shard rebuild of a trainer in this
    process (the flow wraps it in a Prefect subflow); losing more shards than the parity covers raises
    TooManyErasuresError and writes nothing. With ``checkpoint_every``: the run directory records the
    configuration and that the run is unfinished before any work, and ``resume`` continues such a run
    from its checkpoint (see :mod:`dlrmflow.engine.training.checkpoint`).

    ``client``, ``progress``, ``on_metrics`` and ``recovery_runner`` become the run's
    :class:`~.run_context.RunContext`, made here once for the layers below."""
    context = RunContext(client=client, progress=progress, on_metrics=on_metrics, recovery_runner=recovery_runner)
    setup = setup or prepare_run(config)
    config = setup.config
    output = Path(config.output_dir)
    with run_dir_for(output, f"train --mode {config.mode}"):
        if config.checkpoint_every and not config.resume:
            start_run_dir(output, config.model_dump(), dataset_fingerprint=setup.meta.fingerprint,
                          plan_fingerprint=setup.plan_fingerprint, iterations=setup.iterations)
        results = run_trainers(setup, context)
        return _record(setup, output, results)


def _record(setup: RunSetup, output: Path, results: list[dict[str, Any]]) -> dict[str, Any]:
    """Record what the trainers produced (trainer 0's result: the state SHA-256, the final state its servers
    and it wrote into a staged directory, the evaluation): the final state moved into place; the summary."""
    config, lead = setup.config, results[0]
    state = lead["state"]
    digest = state["state_sha256"]
    if state["staged"] is not None:
        commit_state_dir(output, state["staged"])
    log = lead["log"]
    _write_iterations(output / ITERATIONS_FILE, log)
    traffic = {key: sum(r[key] for r in results) for key in ("bytes_fetched", "bytes_written")}
    summary = _summary(setup, traffic, log, lead["metrics"], digest, dense_parameters=state["dense_parameters"])
    summary["peak_cached_rows"] = max(r["peak_cached_rows"] for r in results)  # per trainer: "trainers"
    if len(results) > 1:
        summary["trainers"] = trainers_report(results, log)
    if lead.get("servers"):
        summary["servers"] = lead["servers"]  # each member's worker and host at the end (after rebuilds)
    for section in ("parity", "checkpoint"):
        if section in lead:
            summary[section] = lead[section]
    summary.update(run_timing(lead))  # start-up and finish (launch to first iteration; last to here)
    write_summary(output, summary)
    if config.checkpoint_every:
        finish_run_dir(output)  # after summary.json: a crash in between leaves a resumable run
    return summary


@contextlib.contextmanager
def run_dir_for(output: Path, what: str):
    """Hold the lock on the run directory ``output`` (:mod:`dlrmflow.engine.run_lock`) while a run writes it,
    creating it if missing. A run that fails leaves no directory it created, unless it holds an
    unfinished run that can be resumed (a checkpoint)."""
    made_parents = [p for p in output.parents if not p.exists()]
    output.parent.mkdir(parents=True, exist_ok=True)
    removed = False
    try:
        with output_lock(output, what):
            created = not output.exists()
            output.mkdir(exist_ok=True)
            try:
                yield
            except BaseException:
                if created and unfinished_run_message(output) is None:
                    shutil.rmtree(output, ignore_errors=True)
                    removed = True
                raise
    finally:
        for parent in made_parents if removed else ():  # once the lock file is gone: the ones left empty
            with contextlib.suppress(OSError):
                parent.rmdir()


def trainers_report(results: list[dict[str, Any]], log: dict[str, Any]) -> dict[str, Any]:
    """Per trainer: where it ran and what it moved; totals of the traffic between trainers by kind."""
    between: dict[str, int] = {}
    for result in results:
        for kind, count in result["bytes_to_trainers"].items():
            between[kind] = between.get(kind, 0) + int(count)
    iteration_seconds = float(np.sum(log["iteration_seconds"]))
    return {
        "count": len(results),
        "bytes_between_trainers": between,
        "sync_fraction": float(np.sum(results[0]["sync_seconds"]) / iteration_seconds) if iteration_seconds else 0.0,
        # Per trainer: the most rows its cache held at once; the bytes it received from the other trainers
        # (rows, gradients, dense gradients) and from the servers (bytes_fetched).
        "per_trainer": [{"rank": r["rank"], "worker": r["worker"], "host": host_of(r["worker"], {}),
                         "device": r["device"], "threads": r["threads"],
                         "peak_cached_rows": r["peak_cached_rows"], "peak_rss_bytes": r["peak_rss_bytes"],
                         "bytes_from_trainers": r["bytes_from_trainers"],
                         "bytes_from_servers": r["bytes_fetched"],
                         "bytes_fetched": r["bytes_fetched"], "bytes_written_back": r["bytes_written"],
                         "stall_seconds": float(np.sum(r["log"]["stall_seconds"])),
                         "sync_seconds": float(np.sum(r["sync_seconds"])),
                         **{f"{phase}_seconds": seconds for phase, seconds in r["seconds"].items()}}
                        for r in results],
    }


def _write_iterations(path: Path, log: dict[str, Any]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["iteration", "loss", "iteration_ms", "stall_ms"])
        columns = zip(log["losses"], log["iteration_seconds"], log["stall_seconds"], strict=True)
        for t, (loss, it, stall) in enumerate(columns):
            writer.writerow([t, f"{loss:.6f}", f"{1e3 * it:.3f}", f"{1e3 * stall:.3f}"])


def _summary(setup: RunSetup, traffic: dict[str, int], log: dict, metrics: dict, digest: str, *,
             dense_parameters: int) -> dict[str, Any]:
    config = setup.config
    it, stall = log["iteration_seconds"], log["stall_seconds"]
    plan = setup.plan
    # one trainer's oracle cache: the plan's slots and the spare ones for rows fetched early
    spare = spare_slots(plan, config.capacity) if plan is not None and config.trainers == 1 else 0
    tail = log["losses"][-min(len(log["losses"]), config.metrics_every) :]
    # --eval-every's evaluations, then the final one (none without held-out rows)
    evaluations = [*log["evaluations"], *([evaluation_row(setup.iterations, metrics)] if metrics["eval_rows"] else [])]
    best = best_evaluation(evaluations)
    return {
        "mode": config.mode,
        "dataset": str(config.dataset_dir),
        "dataset_fingerprint": setup.meta.fingerprint,
        "output_dir": str(config.output_dir),
        "device": config.device,
        "iterations": setup.iterations,
        "batch_size": config.batch_size,
        "num_shards": config.num_shards if MODES[config.mode].servers else 0,
        "capacity": (plan.num_slots + spare if plan is not None else config.capacity),
        "plan": None if plan is None else {
            "dir": str(config.plan_dir), "lookahead": plan.config.lookahead,
            "prefetch_distance": plan.config.prefetch_distance, "num_slots": plan.num_slots, "spare_slots": spare,
        },
        "seed": config.seed,
        "model": setup.model_config.name,
        "architecture": architecture(setup.model_config),  # the model's name and every layer size
        "embedding_dim": config.embedding_dim,
        "row_width": setup.spec.dim,  # values per id the model reads (embedding_dim + its per-id weights)
        "dense_parameters": dense_parameters,
        "embedding_optimizer": setup.embedding_optimizer,
        "dense_optimizer": config.dense_optimizer,
        "lr": config.lr,
        "embedding_lr": setup.spec.lr,
        "total_embedding_rows": setup.spec.total_rows,
        "mean_iteration_ms": 1e3 * float(it.mean()),
        "median_iteration_ms": 1e3 * float(np.median(it)),
        "train_seconds": log["train_seconds"],
        "flush_seconds": log["flush_seconds"],
        "stall_seconds": float(stall.sum()),
        "stall_fraction": float(stall.sum() / it.sum()) if it.sum() > 0 else 0.0,
        "bytes_fetched": int(traffic["bytes_fetched"]),
        "bytes_written_back": int(traffic["bytes_written"]),
        "first_train_loss": float(log["losses"][0]),
        "final_train_loss": float(log["losses"][-1]),
        "final_train_loss_mean": float(np.mean(tail)),  # mean over the last metrics_every iterations
        **metrics,
        "state_sha256": digest,
        "metrics_every": config.metrics_every,
        "metrics": log["metrics"],  # per window of metrics_every iterations: loss, ms/iteration, stall ms
        "eval_every": config.eval_every,
        "evaluations": evaluations,  # {iteration, auc, logloss} every eval_every iterations and at the end
        "best_evaluation_iteration": None if best is None else best["iteration"],  # the lowest held-out log loss
        "lr_schedule": {"warmup_steps": config.lr_num_warmup_steps, "decay_start_step": config.lr_decay_start_step,
                        "decay_steps": config.lr_num_decay_steps},
        "init_from": None if setup.init_from is None else init_from_record(setup.init_from),
        **setup.checks,
    }
