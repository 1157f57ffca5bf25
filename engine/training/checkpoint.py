"""Checkpoints: the baseline parity must beat, and what lets a crashed trainer resume.

``--checkpoint-every N`` (the modes whose record says ``checkpoints``, :mod:`.modes`; with or without
``--parity``) checkpoints before iterations ``0, N, 2N, ...``: every embedding shard writes its rows,
overlaid with the rows the trainer holds newer copies of (the pending write-back, the LRU cache, or the
oracle's cache once its prefetch worker is idle, i.e. every eviction before the checkpoint written back),
to its own file, then trainer 0 writes ``checkpoint.pt`` naming them (:mod:`.checkpoint_format`). The rows,
the traffic and the LRU cache's slots come from the row store's checkpoint view (:mod:`.stores.base`), the
same calls in every mode; a store restarted with the cache it had makes the uninterrupted run's fetches and
write-backs, so a resumed run reports the same traffic totals.

Two failures use it:

- a lost shard without parity (a call to its actor fails because its worker died): the trainer
  starts K fresh shards from the checkpoint's files, drops its cache, restores the dense state and
  replays the iterations since the checkpoint (:class:`Checkpointer`, :mod:`.shard_restore`);
- the trainer itself dies (SIGKILL, a crashed flow-run process): ``dlrmflow resume RUN_DIR``
  starts a new trainer from the checkpoint (with parity, the parity shards are re-encoded from the
  restored data shards, streamed to them). The run directory and what a resume checks:
  :mod:`.run_directory`, :mod:`.run_directory_checks`.

The oracle's cache is not in the file: at plan position ``t`` the plan alone says which ids are
cached in which slots (replay its prefetches and evictions of ``0 .. t-1``), and the file holds
their values; the prefetch worker then starts at ``t``.

Training is deterministic, so a replay or a resume recomputes the same bits: the run ends
bit-identical to a failure-free one. Design notes: docs/checkpoint-resume.md.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
from distributed import Client

from dlrmflow.engine.training.checkpoint_format import CheckpointedStore, save_checkpoint
from dlrmflow.engine.training.collectives import TrainerGroup
from dlrmflow.engine.training.run_directory import CHECKPOINT_FILE, CHECKPOINT_ROWS_DIR
from dlrmflow.engine.training.shard_restore import is_lost_shard, restore_checkpoint
from dlrmflow.engine.training.train_log import TrainLog


class Checkpointer:
    """The training loop's checkpoint hook: save before iterations 0, N, 2N, ...; on a lost shard
    (without parity) reload the last checkpoint and tell the loop where to replay from."""

    def __init__(self, run_dir: str | os.PathLike, every: int, client: Client | None, *, config_sha256: str,
                 reload_on_loss: bool = True, resumed_at: int | None = None) -> None:
        self.path = Path(run_dir) / CHECKPOINT_FILE
        self.every, self.client, self.config_sha256 = every, client, config_sha256
        self.reload_on_loss = reload_on_loss
        self.saved_at = -1 if resumed_at is None else resumed_at  # the file already holds that iteration
        self.begin = time.perf_counter()
        self.report: dict[str, Any] = {"every": every, "file": str(self.path), "rows_dir": str(self.path.parent /
                                       CHECKPOINT_ROWS_DIR), "checkpoints": [], "recoveries": [],
                                       "clock_origin": self.begin}  # perf_counter() that detected_s counts from
        self._replaying: dict[str, Any] | None = None

    def before_iteration(self, t: int, store: CheckpointedStore, model: torch.nn.Module,
                         optimizer: torch.optim.Optimizer, log: TrainLog, group: TrainerGroup) -> None:
        """Before iterations 0, N, 2N, ...: every trainer's writes home and gradients applied (the store
        quiesced, a barrier), trainer 0 writes the one checkpoint, and nobody writes before it has read."""
        if t % self.every or t == self.saved_at:
            return
        store.quiesce()
        group.barrier()
        if group.rank == 0:
            self.report["checkpoints"].append(
                save_checkpoint(self.path, t, store, model, optimizer, log, self.config_sha256))
        self.saved_at = t
        group.barrier()

    def before_finish(self, store: CheckpointedStore) -> None:
        """The last write-backs, inside the loop: a loss noticed here is replayed like any other."""
        store.finish()
        store.shards.stats()  # touch every shard: a loss not yet noticed is noticed here

    def can_recover(self, exc: BaseException) -> bool:
        """Whether :meth:`recover` handles ``exc``: a lost shard, when this run reloads on a loss."""
        return self.reload_on_loss and is_lost_shard(exc)

    def recover(self, t: int, store: CheckpointedStore, model: torch.nn.Module,
                optimizer: torch.optim.Optimizer) -> int:
        """After a lost shard at iteration ``t``: reload the last checkpoint; the iteration to replay from."""
        detected = time.perf_counter()
        replay_from = restore_checkpoint(self.path, self.client, store, model, optimizer)
        self._replaying = {"failed_at": t, "replay_from": replay_from, "detected_s": detected - self.begin,
                           "reload_seconds": time.perf_counter() - detected, "_detected": detected}
        self.report["recoveries"].append(self._replaying)
        return replay_from

    def after_iteration(self, t: int) -> None:
        """Once a replay has caught up with the iteration that failed, the recovery's time is recorded."""
        if self._replaying is not None and t >= self._replaying["failed_at"]:
            # the recovery's time: from detection until the replay caught up with the failed iteration
            self._replaying["seconds"] = time.perf_counter() - self._replaying.pop("_detected")
            self._replaying = None
