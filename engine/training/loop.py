"""The training loop: one trainer of a group of W (W = 1 is one trainer alone), whatever the mode.

Per iteration ``t``, on every trainer (``split``: its 1/W slice of the global batch and its distinct
ids, :class:`~dlrmflow.engine.training.batch_split.BatchSplit`)::

    hooks        checkpoint before every N-th iteration; failure injection (trainer 0)
    rates      = the schedule's learning rates of t (dense optimizer here, row updates in the store)
    gathered   = store.gather(t, split, next ids)            gathered.rows [U, width]: weights + optimizer state
    weights    = gathered.rows[:, :dim] (a leaf);  embeddings = weights[split.inverse]
    loss       = BCE(model(dense slice, embeddings)); backward
    dense grads: the trainers' mean, summed in rank order (one trainer: its own)
    dense optimizer step
    store.update(gathered, grad of weights, row lr of t)      the row update: the mode's store

``dim`` is the model's row width (``models.row_width``): every per-id parameter of the model is a
weight of the id's row, so the model is the only part of a run that knows which model it is. The
gradient of a row used several times in a slice is summed by ``index_select``'s backward, in the same
order in every mode. An iteration's time is from its gather to its update; reading the batch happens
between steps and is the same work in every mode.

A lost shard without parity (one trainer, checkpoints on) sends the loop back to the reloaded
checkpoint, which it replays from; progress and metrics are reported once per iteration, not again on
a replay; so is the periodic evaluation (``--eval-every``), which reads the rows as training left them
and touches nothing that training reads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dlrmflow.engine.batch_stream import global_ids
from dlrmflow.engine.models import bce_loss
from dlrmflow.engine.training.batch_split import BatchSplit
from dlrmflow.engine.training.checkpoint import Checkpointer
from dlrmflow.engine.training.collectives import TrainerGroup
from dlrmflow.engine.training.evaluation import evaluation_row
from dlrmflow.engine.training.faults import FaultInjector
from dlrmflow.engine.training.run_setup import RunSetup
from dlrmflow.engine.training.schedule import LrSchedule
from dlrmflow.engine.training.stores.base import RowStore
from dlrmflow.engine.training.train_log import TrainLog
from dlrmflow.engine.training.trainer_slices import BatchSlices

logger = logging.getLogger(__name__)
EMPTY_IDS = np.zeros(0, dtype=np.int64)
# (iterations done, the metrics row due then or None): progress as the loop reports it
Report = Callable[[int, dict[str, Any] | None], None]


@dataclass
class LoopHooks:
    """What a run adds to the iterations: each is optional."""

    checkpoints: Checkpointer | None = None
    injector: FaultInjector | None = None  # trainer 0's: SIGKILL a shard's worker as an iteration starts
    report: Report | None = None
    # --eval-every N (trainer 0 of one): the held-out metrics (``evaluate``'s dict) after t iterations, called
    # after every N-th iteration but the last (the run's final evaluation covers that one)
    evaluate: Callable[[int], dict[str, Any]] | None = None


def train_step(t: int, batch, split: BatchSplit, next_union: np.ndarray, model: torch.nn.Module,
               params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, setup: RunSetup,
               store: RowStore, group: TrainerGroup, device: torch.device, clock: dict[str, float],
               row_lr: float) -> torch.Tensor:
    """One iteration of one trainer (module docstring); returns the trainers' mean loss. ``row_lr``: the
    embedding rows' learning rate at ``t``. Adds to ``clock`` the seconds of forward and backward
    (``compute``) and of the dense gradients' gather (``dense_sync``)."""
    dim = setup.spec.dim
    rows = batch.labels.shape[0]  # this trainer's slice of the global batch
    # torch.tensor copies into torch-allocated (aligned) memory: kernels then take the same code path
    # whatever NumPy's buffer alignment was.
    dense = torch.tensor(batch.dense, device=device)
    labels = torch.tensor(batch.labels, device=device)
    gathered = store.gather(t, split, next_union)
    start = time.perf_counter()
    weights = gathered.rows[:, :dim].clone().requires_grad_(True)
    embeddings = weights.index_select(0, torch.from_numpy(split.inverse).to(device))
    loss = bce_loss(model(dense, embeddings.view(rows, -1, dim)), labels)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    backward_done = time.perf_counter()
    loss = group.average_dense_gradients(params, loss.detach())
    clock["compute"] += backward_done - start
    clock["dense_sync"] += time.perf_counter() - backward_done
    optimizer.step()
    store.update(gathered, weights.grad, row_lr)
    return loss


def train_iterations(setup: RunSetup, group: TrainerGroup, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     store: RowStore, device: torch.device, log: TrainLog, hooks: LoopHooks) -> dict[str, Any]:
    """Iterations ``log.start .. n-1`` of this trainer; every row home at the end (``store.finish``). Returns
    where the time went: ``row_sync`` per iteration (the row gradients' collectives and barriers), and in all
    ``compute`` (forward, backward), ``dense_sync`` (the dense gradients' gather, waiting for the slowest
    trainer included) and ``batches`` (reading the global batch and splitting it)."""
    n, offsets, every = setup.iterations, setup.stream.offsets, setup.config.metrics_every
    eval_every, base_lr, base_row_lr = setup.config.eval_every, setup.config.lr, setup.spec.lr
    schedule = LrSchedule.of(setup.config, setup.steps_before)  # a pure function of t: the same on every trainer
    checkpoints = hooks.checkpoints
    params = list(model.parameters())
    sync_seconds = np.zeros(n)
    clock = {"compute": 0.0, "dense_sync": 0.0, "batches": 0.0}

    # Each trainer reads its slice of every batch; the others' distinct ids come from the run's slices.
    stream = setup.stream if group.size == 1 else setup.stream.sliced(group.rank, group.size)
    slices = None if group.size == 1 else BatchSlices.load(setup.trainers_dir, group.size)

    def split_of(t: int, batch) -> BatchSplit:
        ids = global_ids(batch.sparse, offsets)
        return BatchSplit.of(t, ids, 1, 0) if slices is None else slices.split(t, group.rank, ids)

    log.begin = time.perf_counter()
    t, batches, batch = log.start, None, None
    while True:
        try:
            if t >= n:
                if checkpoints is not None:
                    checkpoints.before_finish(store)  # a loss noticed in the last write-backs is replayed too
                break
            if checkpoints is not None:
                checkpoints.before_iteration(t, store, model, optimizer, log, group)
            if batches is None:
                batches = stream.iter_range(t, n)
                batch = next(batches)
                split = split_of(t, batch)
            if hooks.injector is not None:
                hooks.injector.before_iteration(t)
            reading = time.perf_counter()
            following = next(batches) if t + 1 < n else None
            next_split = None if following is None else split_of(t + 1, following)
            clock["batches"] += time.perf_counter() - reading
            row_lr = base_row_lr
            if not schedule.constant:
                row_lr = schedule.lr(base_row_lr, t)
                for param_group in optimizer.param_groups:
                    param_group["lr"] = schedule.lr(base_lr, t)
            start, stall, sync = time.perf_counter(), store.stall_seconds, store.sync_seconds
            loss = train_step(t, batch, split, EMPTY_IDS if next_split is None else next_split.union, model, params,
                              optimizer, setup, store, group, device, clock, row_lr)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # honest per-iteration times
            log.record(t, loss, time.perf_counter() - start, store.stall_seconds - stall)
            sync_seconds[t] = store.sync_seconds - sync
            batch, split = following, next_split
            t += 1
        except Exception as exc:
            if checkpoints is None or not checkpoints.can_recover(exc):
                raise
            t, batches = checkpoints.recover(t, store, model, optimizer), None
            continue
        if checkpoints is not None:
            checkpoints.after_iteration(t)
        if t > log.done:  # once per iteration, not again on a replay
            log.done = t
            row = log.metrics_row(t, every, n)
            if hooks.report is not None:
                hooks.report(t, row)
            if hooks.evaluate is not None and eval_every and t % eval_every == 0 and t < n:
                evaluation = evaluation_row(t, hooks.evaluate(t))
                log.evaluations.append(evaluation)
                logger.info("iteration %d: held-out AUC %s, log loss %s", t, _figure(evaluation["auc"]),
                            _figure(evaluation["logloss"]))
    return {**clock, "row_sync": sync_seconds}


def _figure(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"
