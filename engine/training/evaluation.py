"""The held-out evaluation: AUC and log loss of the model on the rows a run holds out."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from dlrmflow.engine.batch_stream import Batch, BatchStream, global_ids
from dlrmflow.engine.phases import PhaseProgress
from dlrmflow.engine.training.config import TrainConfig
from dlrmflow.engine.training.metrics import log_loss, roc_auc
from dlrmflow.engine.training.stores.base import RowStore


@torch.no_grad()
def evaluate(setup: Any, model: torch.nn.Module, store: RowStore, device: torch.device, *,
             during_training: bool = False) -> dict[str, Any]:
    """AUC and log loss on the held-out rows: after training (rows read from their home), or, with
    ``during_training``, between two iterations (rows as training left them: ``store.current_rows``).

    It must not perturb training: no random numbers, gradients off, the model in eval mode and back in
    the mode it was in, the store's rows and counters untouched; a run with evaluations ends in the same
    state as one without (tests/test_models.py)."""
    config, meta = setup.config, setup.meta
    read = store.current_rows if during_training else store.read
    was_training = model.training
    model.eval()
    try:
        return _evaluate(setup, config, meta, model, read, device)
    finally:
        model.train(was_training)


def _evaluate(setup: Any, config: TrainConfig, meta: Any, model: torch.nn.Module, read: Any,
              device: torch.device) -> dict[str, Any]:
    if setup.eval_start >= meta.rows:
        return {"eval_rows": 0, "eval_auc": None, "eval_log_loss": None}
    stream = BatchStream(config.dataset_dir, config.eval_batch_size, start_row=setup.eval_start)
    y, p = score_rows(stream, model, read, setup.spec.dim, device,
                      PhaseProgress("final evaluation rows", meta.rows - setup.eval_start))
    auc = roc_auc(y, p)
    return {
        "eval_rows": int(len(y)),
        "eval_auc": None if np.isnan(auc) else auc,
        "eval_log_loss": log_loss(y, p),
    }


def score_rows(stream: BatchStream, model: torch.nn.Module, read: Any, dim: int, device: torch.device,
               progress: Any, on_batch: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """The labels and the model's click probabilities of every row ``stream`` gives; ``read(ids)``: the
    rows of sorted unique global ids as a tensor (their first ``dim`` values are the weights);
    ``on_batch(batch)``: called with each batch, for figures of the data taken on the same pass."""
    labels, probs, done = [], [], 0
    for batch in stream:
        if on_batch is not None:
            on_batch(batch)
        ids = global_ids(batch.sparse, stream.offsets)
        uniq, inverse = np.unique(ids, return_inverse=True)
        weights = read(uniq)[:, :dim]
        embeddings = weights.index_select(0, torch.from_numpy(inverse.reshape(-1)).to(device))
        dense, _ = batch_tensors(batch, device)
        logits = model(dense, embeddings.view(ids.shape[0], ids.shape[1], dim))
        probs.append(torch.sigmoid(logits).cpu().numpy())
        labels.append(batch.labels)
        done += len(batch.labels)
        progress(done)
    return np.concatenate(labels), np.concatenate(probs)


def batch_tensors(batch: Batch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # torch.tensor copies into torch-allocated (aligned) memory: kernels then take the same
    # code path whatever NumPy's buffer alignment was.
    return torch.tensor(batch.dense, device=device), torch.tensor(batch.labels, device=device)


def evaluation_row(t: int, metrics: dict[str, Any]) -> dict[str, Any]:
    """An evaluation after ``t`` iterations as summary.json's ``evaluations`` list records it."""
    return {"iteration": t, "auc": metrics["eval_auc"], "logloss": metrics["eval_log_loss"]}


def best_evaluation(evaluations: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The evaluation of the lowest held-out log loss (the training objective; the earliest on a tie)."""
    scored = [e for e in evaluations if e["logloss"] is not None]
    return min(scored, key=lambda e: (e["logloss"], e["iteration"])) if scored else None

