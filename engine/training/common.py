"""What every trainer process uses, one trainer or several (:mod:`.rank`, :mod:`.workers`):
deterministic kernels, the dense optimizer, a batch's tensors, the per-iteration log, the evaluation
on the held-out rows and the final state's layout (its dense part; :mod:`.final_state` writes it)."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from dlrmflow.engine.batches import Batch, BatchStream, global_ids
from dlrmflow.engine.phases import PhaseProgress
from dlrmflow.engine.run_state import FORMAT_VERSION
from dlrmflow.engine.training.config import TrainConfig
from dlrmflow.engine.training.metrics import log_loss, roc_auc
from dlrmflow.engine.training.stores.base import RowStore


@contextlib.contextmanager
def deterministic_torch(device: torch.device):
    """Deterministic kernels for the duration of a run (restores the previous setting)."""
    if device.type == "cuda":
        # cuBLAS is deterministic only with a fixed workspace (must be set before its first use).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


def make_dense_optimizer(config: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    if config.dense_optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=config.lr)
    return torch.optim.SGD(model.parameters(), lr=config.lr)


def start_from_run(setup: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The dense parameters and the dense optimizer's state of the finished run ``setup.init_from``
    (:mod:`.continuation`); this run's own learning rate (the saved state carries the run's)."""
    from dlrmflow.engine.run_state import load_dense

    state = load_dense(setup.init_from.state_dir)
    model.load_state_dict(state["dense"])
    optimizer.load_state_dict(state["dense_optimizer"])
    for group in optimizer.param_groups:
        group["lr"] = setup.config.lr


def batch_tensors(batch: Batch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # torch.tensor copies into torch-allocated (aligned) memory: kernels then take the same
    # code path whatever NumPy's buffer alignment was.
    return torch.tensor(batch.dense, device=device), torch.tensor(batch.labels, device=device)


@dataclass
class TrainLog:
    """What the loop records per iteration. A checkpoint carries it (:meth:`snapshot`), so a resumed
    run reports every iteration's loss, not only those after the resume."""

    losses: list  # 0-d loss tensors (None: not trained yet)
    iteration_seconds: np.ndarray
    stall_seconds: np.ndarray
    metrics: list[dict[str, Any]]
    evaluations: list[dict[str, Any]] = field(default_factory=list)  # --eval-every: {iteration, auc, logloss}
    start: int = 0  # the first iteration this process trains (a resume: the checkpoint's)
    done: int = 0  # iterations reported (progress, metrics): a replay does not report them again
    seconds_before: float = 0.0  # training time before the resume
    begin: float = field(default_factory=time.perf_counter)

    @classmethod
    def empty(cls, n: int) -> TrainLog:
        return cls([None] * n, np.zeros(n), np.zeros(n), [])

    def record(self, t: int, loss: torch.Tensor, seconds: float, stall: float) -> None:
        self.losses[t], self.iteration_seconds[t], self.stall_seconds[t] = loss, seconds, stall

    def snapshot(self, t: int) -> dict[str, Any]:
        """The log of iterations ``0..t-1`` (what a checkpoint before iteration ``t`` holds)."""
        return {"losses": torch.stack(self.losses[:t]).cpu() if t else torch.zeros(0),
                "iteration_seconds": torch.from_numpy(self.iteration_seconds[:t].copy()),
                "stall_seconds": torch.from_numpy(self.stall_seconds[:t].copy()),
                "metrics": [dict(m) for m in self.metrics if m["iteration"] <= t],
                "evaluations": [dict(e) for e in self.evaluations if e["iteration"] <= t],
                "seconds": self.seconds_before + time.perf_counter() - self.begin}

    @classmethod
    def restore(cls, n: int, snap: dict[str, Any], device: torch.device) -> TrainLog:
        log = cls.empty(n)
        t = len(snap["losses"])
        log.losses[:t] = list(snap["losses"].to(device).unbind())
        log.iteration_seconds[:t] = snap["iteration_seconds"].numpy()
        log.stall_seconds[:t] = snap["stall_seconds"].numpy()
        log.metrics = [dict(m) for m in snap["metrics"]]
        log.evaluations = [dict(e) for e in snap.get("evaluations", [])]  # none in an older checkpoint
        log.start = log.done = t
        log.seconds_before = float(snap["seconds"])
        return log

    def metrics_row(self, t: int, every: int, n: int) -> dict[str, Any] | None:
        """After ``t`` of ``n`` iterations, the metrics row due then (every ``every`` and at the end), appended
        to :attr:`metrics`: the mean loss, ms per iteration and stall since the previous row; else None."""
        if t % every and t != n:
            return None
        lo = self.metrics[-1]["iteration"] if self.metrics else 0
        row = {"iteration": t, "loss": float(torch.stack(self.losses[lo:t]).mean()),
               "iteration_ms": 1e3 * float(self.iteration_seconds[lo:t].mean()),
               "stall_ms": 1e3 * float(self.stall_seconds[lo:t].mean())}
        self.metrics.append(row)
        return row

    def result(self) -> dict[str, Any]:
        return {
            "losses": torch.stack(self.losses).cpu().numpy().astype(np.float64),
            "iteration_seconds": self.iteration_seconds,
            "stall_seconds": self.stall_seconds,
            "train_seconds": self.seconds_before + time.perf_counter() - self.begin,
            "metrics": self.metrics,
            "evaluations": self.evaluations,
        }


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


def evaluation_row(t: int, metrics: dict[str, Any]) -> dict[str, Any]:
    """An evaluation after ``t`` iterations as summary.json's ``evaluations`` list records it."""
    return {"iteration": t, "auc": metrics["eval_auc"], "logloss": metrics["eval_log_loss"]}


def best_evaluation(evaluations: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The evaluation of the lowest held-out log loss (the training objective; the earliest on a tie)."""
    scored = [e for e in evaluations if e["logloss"] is not None]
    return min(scored, key=lambda e: (e["logloss"], e["iteration"])) if scored else None


def dense_state(setup: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The final state in the layout documented in :mod:`dlrmflow.engine.run_state`, but the embedding rows
    (what dense.pt holds)."""
    spec = setup.spec
    return {
        "format_version": FORMAT_VERSION,
        "mode": setup.config.mode,
        "model": setup.model_config.name,
        "model_config": asdict(setup.model_config),
        "dense": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "dense_optimizer": to_cpu(optimizer.state_dict()),
        "embedding": {
            "dim": spec.dim,
            "optimizer": spec.optimizer,
            "state_width": spec.state_width,
            "table_offsets": list(spec.table_offsets),
            "cardinalities": list(spec.cardinalities),
        },
    }


def collect_state(setup: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, store: RowStore) -> dict:
    """The whole final state, every embedding row gathered into this process (``store.all_rows()``): what a
    run collected before each shard wrote its own file; tests compare the files with it."""
    state = dense_state(setup, model, optimizer)
    rows = torch.from_numpy(np.ascontiguousarray(store.all_rows()))
    state["embedding"] = {"rows": rows, **state["embedding"]}
    return state


def to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_cpu(v) for v in obj]
    return obj
