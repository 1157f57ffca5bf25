"""Train a model (:mod:`dlrmflow.engine.models`) in one of four modes; every mode ends in bit-identical
parameters.

    local    all embedding rows in the trainer's memory (the reference)
    remote   rows on K embedding servers, fetched and written back every iteration
    lru      rows on the servers, an on-demand LRU cache of ``capacity`` rows in the trainer
    oracle   rows on the servers, a cache driven by a lookahead plan, prefetched in the background

One iteration, the same in every mode (only ``store`` differs)::

    ids      = global ids of the batch [B, T];  uniq, inverse = unique(ids)   (sorted)
    block    = store.gather(t, uniq)            [U, width] rows: weights + optimizer state
    weights  = block[:, :dim] (a leaf);  embeddings = weights[inverse]   [B, T, dim]
    loss     = BCE(model(dense, embeddings), labels);  backward
    dense optimizer step;  apply_update(block, grad of weights)    (row-wise, per distinct id)
    store.scatter(t, uniq, block)

``dim`` is the model's row width (``models.row_width``): every per-id parameter of the model
(DeepFM's first-order weight as much as its factor vector) is a weight of the id's row, so the
model is the only part of a run that knows which model it is.

The gradient of a row used several times in a batch is summed by ``index_select``'s backward
(``index_add_``), in the same order in every mode. Deterministic algorithms are switched on
for the run. Data: training runs the first ``iterations`` batches of
``BatchStream(dataset, batch_size)`` (the stream a plan is made for); the last
``eval_fraction`` of the dataset's rows are held out for AUC and log loss and must not
overlap the training batches.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from dlrmflow.datasets.meta import DatasetMeta, read_meta
from dlrmflow.engine.batches import Batch, BatchStream, batches_ending_by, global_ids
from dlrmflow.engine.coding.erasure import TooManyErasuresError
from dlrmflow.engine.coding.start import start_coded_shards
from dlrmflow.engine.coding.verify import parity_report
from dlrmflow.engine.models import architecture, bce_loss, build_model, model_config, row_width
from dlrmflow.engine.planning.planner import CapacityError, load_plan
from dlrmflow.engine.run_lock import output_lock
from dlrmflow.engine.run_state import ITERATIONS_FILE, save_state, state_hash, write_summary
from dlrmflow.engine.serving.embedding_rows import RowSpec, apply_update
from dlrmflow.engine.serving.shards import start_shards
from dlrmflow.engine.training.checkpoint import (
    Checkpointer,
    cache_of,
    check_resumable,
    config_sha256,
    finish_run_dir,
    load_resume_point,
    refuse_unfinished_run,
    restore_dense,
    start_placed_shards,
    start_run_dir,
    unfinished_run_message,
)
from dlrmflow.engine.training.common import (
    TrainLog,
    batch_tensors,
    collect_state,
    deterministic_torch,
    evaluate,
    make_dense_optimizer,
)
from dlrmflow.engine.training.config import TrainConfig, TrainConfigError
from dlrmflow.engine.training.faults import FaultInjector, Kill, check_kills, kills_since
from dlrmflow.engine.training.prefetch import PrefetchError
from dlrmflow.engine.training.stores import LocalRows, LruRows, OracleRows, RemoteRows, RowStore
from dlrmflow.engine.training.trainers import run_trainers

Progress = Callable[[int, int], None]
MetricsCallback = Callable[[dict[str, Any]], None]


@dataclass
class RunSetup:
    """A checked configuration: everything resolved before any work starts (:func:`prepare_run`).

    Made once per run and handed down (CLI check, flow, task, :func:`train`) rather than recomputed:
    making it reads the plan and, in lru mode, scans every training batch's ids."""

    config: TrainConfig
    meta: DatasetMeta
    stream: BatchStream
    iterations: int
    eval_start: int  # held-out rows [eval_start, meta.rows)
    model_config: Any  # the model's checked architecture (dlrmflow.engine.models.model_config)
    spec: RowSpec
    plan: Any = None
    checks: dict[str, Any] = field(default_factory=dict)
    kills: list[Kill] = field(default_factory=list)  # the parsed kills
    plan_fingerprint: str | None = None
    resume_at: int | None = None  # resume: the iteration of the checkpoint the run continues from


def _max_distinct_rows(stream: BatchStream, iterations: int) -> int:
    """The most distinct embedding rows any of the first ``iterations`` batches uses."""
    ids_only = BatchStream(
        stream.dataset_dir, stream.batch_size, drop_last=stream.drop_last, sparse_only=True
    )
    most = 0
    for batch in ids_only.iter_range(0, iterations):
        most = max(most, len(np.unique(global_ids(batch.sparse, ids_only.offsets))))
    return most


def prepare_run(config: TrainConfig, *, plan=None) -> RunSetup:
    """Check ``config`` (valid by construction) against the dataset, the plan, the device and the run
    directory; resolve the iteration count. Raises a UserInputError whose message names the field.

    ``plan``: an already loaded plan for ``--mode oracle`` (else it is loaded from ``plan_dir``)."""
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise TrainConfigError(f"device: --device {config.device}: no CUDA GPU is available")
    if config.mode == "lru" and config.capacity is None:
        raise CapacityError("capacity: --mode lru needs --capacity ROWS (>= 1)")
    meta = read_meta(config.dataset_dir)  # DatasetError (a UserInputError) if missing or broken
    architecture_config = model_config(config.model, config, num_dense=len(meta.dense_columns),
                                       num_tables=len(meta.sparse_columns))

    drop_last = False
    if config.mode == "oracle":
        if plan is None and not config.plan_dir:
            raise TrainConfigError("plan_dir: --mode oracle needs --plan PLAN_DIR (make one with `dlrmflow plan`)")
        if plan is None:
            plan = load_plan(config.plan_dir, dataset_dir=config.dataset_dir, batch_size=config.batch_size)
        if plan.config.batch_size != config.batch_size:
            raise TrainConfigError(f"batch_size: the plan was made for batch size {plan.config.batch_size}, "
                                   f"not --batch-size {config.batch_size}")
        drop_last = bool(plan.config.drop_last)
    elif plan is not None:
        raise TrainConfigError(f"plan_dir: --plan is only used by --mode oracle, not --mode {config.mode}")

    stream = BatchStream(config.dataset_dir, config.batch_size, drop_last=drop_last)
    eval_rows = int(round(config.eval_fraction * meta.rows))
    eval_start = meta.rows - eval_rows
    if config.eval_fraction > 0 and eval_rows == 0:
        raise TrainConfigError(f"eval_fraction: --eval-fraction {config.eval_fraction} of {meta.rows} rows holds "
                               "out no row")
    fit = batches_ending_by(meta.rows, config.batch_size, eval_start, drop_last=drop_last)
    if fit == 0:
        held_out = f", {eval_rows} of {meta.rows} held out for evaluation" if eval_rows else ""
        raise TrainConfigError(
            f"batch_size: --batch-size {config.batch_size} is larger than the {eval_start} training rows of the "
            f"dataset{held_out}: no whole batch fits (lower --batch-size"
            f"{' or --eval-fraction' if eval_rows else ''})")
    iterations = fit if config.iterations is None else config.iterations
    if iterations > fit:
        raise TrainConfigError(
            f"iterations: --iterations {iterations} is beyond the data: {meta.rows} rows with {eval_rows} held "
            f"out for evaluation leave {fit} batches of {config.batch_size} (lower --iterations, --batch-size "
            "or --eval-fraction)"
        )
    spec = RowSpec(
        dim=row_width(config.model, config.embedding_dim),
        optimizer=config.embedding_optimizer,
        seed=config.seed,
        table_offsets=tuple(meta.table_offsets),
        cardinalities=tuple(meta.cardinalities),
        lr=config.embedding_lr if config.embedding_lr is not None else config.lr,
    )
    checks: dict[str, Any] = {}
    if plan is not None:
        if plan.num_iterations < iterations:
            raise TrainConfigError(
                f"iterations: the plan covers {plan.num_iterations} iterations, fewer than --iterations {iterations}"
            )
        if config.capacity is not None and plan.num_slots > config.capacity:
            raise CapacityError(f"capacity: the plan needs a cache of {plan.num_slots} rows, more than --capacity "
                                f"{config.capacity}")
    if config.mode == "lru":
        most = _max_distinct_rows(stream, iterations)  # a pass over the ids only
        checks["max_distinct_rows_per_batch"] = most
        if most > config.capacity:
            raise CapacityError(f"capacity: --capacity {config.capacity} is too small: a batch uses up to {most} "
                                "distinct embedding rows")
    kills = check_kills(config.kills, num_shards=config.num_shards, parity=config.parity, iterations=iterations)
    plan_fp = plan_fingerprint(plan)
    resume_at = None
    if config.resume:  # ResumeError: no checkpoint, a finished run, changed data or plan, another configuration
        resume_at = check_resumable(config.output_dir, config.model_dump(), dataset_fingerprint=meta.fingerprint,
                                    plan_fingerprint=plan_fp, iterations=iterations)
    else:
        refuse_unfinished_run(config.output_dir)  # names `dlrmflow resume RUN_DIR`
    return RunSetup(config, meta, stream, iterations, eval_start, architecture_config, spec, plan, checks, kills,
                    plan_fp, resume_at)


def plan_fingerprint(plan) -> str | None:
    """SHA-256 of a plan's plan.json (its dataset, settings, counts and files); None without a plan."""
    info = getattr(plan, "info", None)
    if info is None:
        return None
    return hashlib.sha256(json.dumps(info, sort_keys=True, default=str).encode()).hexdigest()


def make_store(setup: RunSetup, device: torch.device, client, recovery_runner=None,
               rows: np.ndarray | None = None, start_at: int = 0) -> RowStore:
    """The mode's row store; ``rows``: the shards start from these rows (a resumed checkpoint's, taken
    before iteration ``start_at``: the oracle store starts at that plan position)."""
    config = setup.config
    if config.mode == "local":
        return LocalRows(setup.spec, device)
    if client is None:
        raise ValueError(f"--mode {config.mode} needs a Dask client to host the embedding servers")
    if config.parity:
        shards = start_coded_shards(client, setup.spec, config.num_shards, config.parity, rows=rows,
                                    rebuild_chunk=config.rebuild_chunk, parity_batches=config.parity_batches,
                                    rebuild_rate=config.rebuild_rate * 1e6, recovery_runner=recovery_runner)
    elif config.checkpoint_every:
        shards = start_placed_shards(client, setup.spec, config.num_shards, rows)
    else:
        shards = start_shards(client, setup.spec, config.num_shards)
    if config.mode == "remote":
        return RemoteRows(setup.spec, device, shards)
    if config.mode == "lru":
        return LruRows(setup.spec, device, shards, config.capacity)
    return OracleRows(setup.spec, device, shards, setup.plan, setup.iterations, start=start_at, rows=rows)


def train_step(
    t: int, batch: Batch, offsets: np.ndarray, model: torch.nn.Module, dense_optimizer: torch.optim.Optimizer,
    spec: RowSpec, store: RowStore, device: torch.device,
) -> torch.Tensor:
    """One iteration (see the module docstring); returns the batch loss (a 0-d tensor)."""
    ids = global_ids(batch.sparse, offsets)
    uniq, inverse = np.unique(ids, return_inverse=True)
    block = store.gather(t, uniq)
    weights = block[:, : spec.dim].clone().requires_grad_(True)
    embeddings = weights.index_select(0, torch.from_numpy(inverse.reshape(-1)).to(device))
    dense, labels = batch_tensors(batch, device)
    loss = bce_loss(model(dense, embeddings.view(ids.shape[0], ids.shape[1], spec.dim)), labels)
    dense_optimizer.zero_grad(set_to_none=True)
    loss.backward()
    dense_optimizer.step()
    apply_update(spec, block, weights.grad)
    store.scatter(t, uniq, block)
    return loss.detach()


def train(
    config: TrainConfig,
    *,
    client=None,
    progress: Progress | None = None,
    on_metrics: MetricsCallback | None = None,
    setup: RunSetup | None = None,
    recovery_runner: Callable | None = None,
) -> dict[str, Any]:
    """Run one training job; write final_state.pt, summary.json and iterations.csv; return the summary.

    With ``parity``: ``recovery_runner(rebuild, info)`` runs each shard rebuild (the flow wraps it in
    a Prefect subflow); losing more shards than the parity covers raises TooManyErasuresError and
    writes nothing. With ``checkpoint_every``: the run directory records the configuration and that
    the run is unfinished before any work, and ``resume`` continues such a run from its checkpoint
    (see :mod:`dlrmflow.engine.training.checkpoint`)."""
    setup = setup or prepare_run(config)
    output = Path(setup.config.output_dir)
    with run_dir_for(output, f"train --mode {setup.config.mode}"):
        if setup.config.trainers > 1:
            return _train_with_trainers(setup, output, client, progress, on_metrics)
        return _train(setup, output, client, progress, on_metrics, recovery_runner)


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


def _train(setup: RunSetup, output: Path, client, progress: Progress | None, on_metrics: MetricsCallback | None,
           recovery_runner: Callable | None) -> dict[str, Any]:
    config = setup.config
    device = torch.device(config.device)
    resumed = None
    if config.resume:
        resumed = load_resume_point(output, config.model_dump(), setup.spec, setup.iterations)
    elif config.checkpoint_every:
        start_run_dir(output, config.model_dump(), dataset_fingerprint=setup.meta.fingerprint,
                      plan_fingerprint=setup.plan_fingerprint, iterations=setup.iterations)
    with deterministic_torch(device):
        model = build_model(setup.model_config, seed=config.seed).to(device)
        optimizer = make_dense_optimizer(config, model)
        history = TrainLog.empty(setup.iterations)
        rows = None
        if resumed is not None:
            restore_dense(resumed, model, optimizer)
            history = TrainLog.restore(setup.iterations, resumed["log"], device)
            rows = resumed.pop("rows").numpy()
        store = make_store(setup, device, client, recovery_runner, rows,
                           start_at=0 if resumed is None else int(resumed["iteration"]))
        if resumed is not None:
            store.bytes_fetched, store.bytes_written = (resumed["traffic"]["bytes_fetched"],
                                                        resumed["traffic"]["bytes_written"])
            store.restore_cache(cache_of(resumed), rows)
        del rows
        group = getattr(store, "shards", None)
        injector = FaultInjector(setup.kills, client, lambda s: store.shards.worker_of[s], config.num_shards) \
            if setup.kills else None
        checkpoints = None
        if config.checkpoint_every:
            checkpoints = Checkpointer(output, config.checkpoint_every, client,
                                       config_sha256=config_sha256(config.model_dump()),
                                       reload_on_loss=not config.parity,
                                       resumed_at=None if resumed is None else history.start)
        try:
            try:
                log = _train_loop(setup, model, optimizer, store, device, progress, on_metrics, injector,
                                  checkpoints, history)
                start = time.perf_counter()
                store.finish()
            except PrefetchError as exc:  # the oracle's worker met the fatal loss first: name the loss
                if isinstance(exc.__cause__, TooManyErasuresError):
                    raise exc.__cause__ from None
                raise
            log["flush_seconds"] = time.perf_counter() - start
            log["train_seconds"] += log["flush_seconds"]
            metrics = evaluate(setup, model, store, device)
            state = collect_state(setup, model, optimizer, store)
            parity = parity_report(group, output if config.save_state else None) if config.parity else None
        finally:
            store.close()
    digest = state_hash(state)
    if config.save_state:
        save_state(output, state)
    _write_iterations(output / ITERATIONS_FILE, log)
    summary = _summary(setup, store, log, metrics, digest,
                       dense_parameters=sum(value.numel() for value in state["dense"].values()))
    kills = injector.log if injector else []
    if checkpoints is not None:
        summary["checkpoint"] = {**checkpoints.report, "kills": kills_since(kills, checkpoints.begin)}
        if resumed is not None:
            summary["checkpoint"]["resumed_from"] = int(resumed["iteration"])
    if parity is not None:
        summary["parity"] = {**parity, "kills": kills_since(kills, group.started_at)}
    write_summary(output, summary)
    if config.checkpoint_every:
        finish_run_dir(output)  # after summary.json: a crash in between leaves a resumable run
    return summary


def _train_with_trainers(setup: RunSetup, output: Path, client, progress: Progress | None,
                         on_metrics: MetricsCallback | None) -> dict[str, Any]:
    """``--trainers W``: the trainers train on Dask workers (:mod:`dlrmflow.engine.training.trainers`); trainer 0
    starts the servers and returns the final state and the evaluation, which this process records."""
    config = setup.config
    if client is None:
        raise ValueError(f"--trainers {config.trainers} needs a Dask client to run the trainers on")
    if config.checkpoint_every and not config.resume:
        start_run_dir(output, config.model_dump(), dataset_fingerprint=setup.meta.fingerprint,
                      plan_fingerprint=setup.plan_fingerprint, iterations=setup.iterations)
    results = run_trainers(setup, client, progress=progress, on_metrics=on_metrics)
    lead = results[0]
    state = lead["state"]
    digest = state_hash(state)
    if config.save_state:
        save_state(output, state)
    log = lead["log"]
    _write_iterations(output / ITERATIONS_FILE, log)
    traffic = SimpleNamespace(bytes_fetched=sum(r["bytes_fetched"] for r in results),
                              bytes_written=sum(r["bytes_written"] for r in results))
    summary = _summary(setup, traffic, log, lead["metrics"], digest,
                       dense_parameters=sum(value.numel() for value in state["dense"].values()))
    summary["trainers"] = trainers_report(results, log)
    for section in ("parity", "checkpoint"):
        if section in lead:
            summary[section] = lead[section]
    write_summary(output, summary)
    if config.checkpoint_every:
        finish_run_dir(output)  # after summary.json: a crash in between leaves a resumable run
    return summary


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
        "per_trainer": [{"rank": r["rank"], "worker": r["worker"], "threads": r["threads"],
                         "bytes_fetched": r["bytes_fetched"], "bytes_written_back": r["bytes_written"],
                         "stall_seconds": float(np.sum(r["log"]["stall_seconds"])),
                         "sync_seconds": float(np.sum(r["sync_seconds"])),
                         **{f"{phase}_seconds": seconds for phase, seconds in r["seconds"].items()}}
                        for r in results],
    }


def _train_loop(setup, model, optimizer, store, device, progress, on_metrics, injector=None,
                checkpoints: Checkpointer | None = None, log: TrainLog | None = None) -> dict[str, Any]:
    """Iterations ``log.start .. n-1``. With ``checkpoints``: a checkpoint before every N-th iteration,
    and after a lost shard the loop goes back to the reloaded checkpoint and replays from there."""
    config, n, offsets = setup.config, setup.iterations, setup.stream.offsets
    log = log or TrainLog.empty(n)
    log.begin = time.perf_counter()
    t, batches = log.start, None
    while True:
        try:
            if t >= n:
                if checkpoints is not None:
                    checkpoints.before_finish(store)
                break
            if checkpoints is not None:
                checkpoints.before_iteration(t, store, model, optimizer, log)
            if batches is None:
                batches = setup.stream.iter_range(t, n)
            batch = next(batches)
            if injector is not None:
                injector.before_iteration(t)  # failure injection: SIGKILL a shard's worker
            # An iteration's time is its train step (gather, compute, update, scatter); reading the batch
            # from Parquet happens between steps and is the same work in every mode.
            start, stall_before = time.perf_counter(), store.stall_seconds
            loss = train_step(t, batch, offsets, model, optimizer, setup.spec, store, device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # honest per-iteration times
            log.record(t, loss, time.perf_counter() - start, store.stall_seconds - stall_before)
            t += 1
        except Exception as exc:
            if checkpoints is None or not checkpoints.can_recover(exc):
                raise
            t, batches = checkpoints.recover(t, store, model, optimizer), None
            continue
        if checkpoints is not None:
            checkpoints.after_iteration(t)
        if t > log.done:  # progress and metrics once per iteration, not again on a replay
            log.done = t
            if progress is not None:
                progress(t, n)
            row = log.metrics_row(t, config.metrics_every, n)
            if row is not None and on_metrics is not None:
                on_metrics(row)
    return log.result()


def _write_iterations(path: Path, log: dict[str, Any]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["iteration", "loss", "iteration_ms", "stall_ms"])
        columns = zip(log["losses"], log["iteration_seconds"], log["stall_seconds"], strict=True)
        for t, (loss, it, stall) in enumerate(columns):
            writer.writerow([t, f"{loss:.6f}", f"{1e3 * it:.3f}", f"{1e3 * stall:.3f}"])


def _summary(setup: RunSetup, store: RowStore, log: dict, metrics: dict, digest: str, *,
             dense_parameters: int) -> dict[str, Any]:
    config = setup.config
    it, stall = log["iteration_seconds"], log["stall_seconds"]
    plan = setup.plan
    tail = log["losses"][-min(len(log["losses"]), config.metrics_every) :]
    return {
        "mode": config.mode,
        "dataset": str(config.dataset_dir),
        "dataset_fingerprint": setup.meta.fingerprint,
        "output_dir": str(config.output_dir),
        "device": config.device,
        "iterations": setup.iterations,
        "batch_size": config.batch_size,
        "num_shards": config.num_shards if config.mode != "local" else 0,
        "capacity": (plan.num_slots if plan is not None else config.capacity),
        "plan": None if plan is None else {
            "dir": str(config.plan_dir), "lookahead": plan.config.lookahead,
            "prefetch_distance": plan.config.prefetch_distance, "num_slots": plan.num_slots,
        },
        "seed": config.seed,
        "model": setup.model_config.name,
        "architecture": architecture(setup.model_config),  # the model's name and every layer size
        "embedding_dim": config.embedding_dim,
        "row_width": setup.spec.dim,  # values per id the model reads (embedding_dim + its per-id weights)
        "dense_parameters": dense_parameters,
        "embedding_optimizer": config.embedding_optimizer,
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
        "bytes_fetched": int(store.bytes_fetched),
        "bytes_written_back": int(store.bytes_written),
        "first_train_loss": float(log["losses"][0]),
        "final_train_loss": float(log["losses"][-1]),
        "final_train_loss_mean": float(np.mean(tail)),  # mean over the last metrics_every iterations
        **metrics,
        "state_sha256": digest,
        "metrics_every": config.metrics_every,
        "metrics": log["metrics"],  # per window of metrics_every iterations: loss, ms/iteration, stall ms
        **setup.checks,
    }
