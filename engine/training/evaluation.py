"""The held-out evaluation: AUC and log loss of the model on the rows a run holds out, in this process.

Each pass leaves a mergeable summary of the scores (:class:`~.metrics.ScoreSummary`), not the scores:
its memory is a chunk of rows and the distinct scores, and the same computation, run a part per Dask
task (:mod:`.cluster_scoring`), merges into the same bits."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from dlrmflow.engine.batch_stream import Batch, BatchStream, global_ids
from dlrmflow.engine.phases import PhaseProgress
from dlrmflow.engine.training.config import TrainConfig
from dlrmflow.engine.training.metrics import ScoreSummary, SummaryMerger
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
        return held_out_metrics(None)
    stream = BatchStream(config.dataset_dir, config.eval_batch_size, start_row=setup.eval_start)
    summary, _ = score_stream(stream, model, read, setup.spec.dim, device,
                              PhaseProgress("final evaluation rows", meta.rows - setup.eval_start))
    return held_out_metrics(summary)


def held_out_metrics(summary: ScoreSummary | None) -> dict[str, Any]:
    """The summary's evaluation fields from the merged scores of the held-out rows (None: no rows held out)."""
    if summary is None or summary.rows == 0:
        return {"eval_rows": 0, "eval_auc": None, "eval_log_loss": None}
    return {"eval_rows": summary.rows, "eval_auc": summary.auc(), "eval_log_loss": summary.log_loss()}


# Rows scored before their labels and probabilities are folded into a summary: the scores a pass keeps
# are at most this many rows plus the distinct scores seen so far, whatever the number of rows.
SUMMARY_CHUNK_ROWS = 1 << 20


def score_stream(stream: BatchStream, model: torch.nn.Module, read: Any, dim: int, device: torch.device,
                 progress: Any, *, known_rows: Sequence[int] | None = None,
                 on_scores: Callable[[np.ndarray, np.ndarray], None] | None = None) -> tuple[ScoreSummary, int]:
    """Score every row ``stream`` gives: the mergeable summary of their labels and the model's click
    probabilities (:class:`~.metrics.ScoreSummary`), and how many lookups (rows x tables) met an id at or
    beyond ``known_rows[k]`` in its table ``k`` (0 without ``known_rows``).

    ``read(ids)``: the rows of sorted unique global ids as a tensor (their first ``dim`` values are the
    weights). Every way of scoring (in this process, or a part per Dask task) runs this on batches cut
    alike from the same rows, so each row gets the same probability bits, and the summaries merge
    exactly: the metrics do not depend on how the rows were split. ``on_scores(labels, probabilities)``:
    each batch's, in stream order (``dlrmflow predict`` writes them)."""
    merger = SummaryMerger()
    labels: list[np.ndarray] = []
    probs: list[np.ndarray] = []
    pending = done = new_lookups = 0
    had = None if known_rows is None else np.asarray(known_rows, np.int64)[None, :]
    for batch in stream:
        if had is not None:
            new_lookups += int(np.count_nonzero(np.asarray(batch.sparse) >= had))
        ids = global_ids(batch.sparse, stream.offsets)
        uniq, inverse = np.unique(ids, return_inverse=True)
        weights = read(uniq)[:, :dim]
        embeddings = weights.index_select(0, torch.from_numpy(inverse.reshape(-1)).to(device))
        dense, _ = batch_tensors(batch, device)
        logits = model(dense, embeddings.view(ids.shape[0], ids.shape[1], dim))
        probs.append(torch.sigmoid(logits).cpu().numpy())
        labels.append(batch.labels)
        if on_scores is not None:
            on_scores(batch.labels, probs[-1])
        pending += len(batch.labels)
        if pending >= SUMMARY_CHUNK_ROWS:
            merger.add(ScoreSummary.of(np.concatenate(labels), np.concatenate(probs)))
            labels, probs, pending = [], [], 0
        done += len(batch.labels)
        progress(done)
    if labels:
        merger.add(ScoreSummary.of(np.concatenate(labels), np.concatenate(probs)))
    return merger.result(), new_lookups


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

