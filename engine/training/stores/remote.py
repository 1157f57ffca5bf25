"""``remote``: rows on the embedding servers, no cache: the parameter-server baseline, and with several
trainers the W-trainer reference (docs/trainers.md)."""

from __future__ import annotations

import time

import numpy as np
import torch

from dlrmflow.engine.serving.embedding_rows import RowSpec
from dlrmflow.engine.serving.shards import ShardGroup
from dlrmflow.engine.training.batch_split import BatchSplit
from dlrmflow.engine.training.collectives import TrainerGroup, sum_over_users
from dlrmflow.engine.training.row_updates import apply_update, apply_update_rowwise
from dlrmflow.engine.training.run_setup import RunSetup
from dlrmflow.engine.training.stores.base import IterationRows, RowStore, rule_at
from dlrmflow.engine.training.stores.homes import ShardHome
from dlrmflow.engine.training.stores.sync import WriteThrough, gather_gradients


class RemoteRows(RowStore):
    """Every iteration: fetch all its rows, train, write them all back.

    The write-back of iteration ``t`` travels in the same round trip as the fetch of ``t + 1``
    (each shard applies the write first), so a row is never read stale and each iteration costs
    one round trip per shard; the last write-back happens in :meth:`finish`."""

    def __init__(self, spec: RowSpec, device: torch.device, shards: ShardGroup) -> None:
        self.spec, self.device = spec, device
        self.home = ShardHome(spec, shards)
        self.stall_seconds = 0.0
        self._pending_ids = np.zeros(0, dtype=np.int64)  # the last iteration's rows, not yet sent home
        self._pending_rows = np.zeros((0, spec.width), dtype=np.float32)

    def gather(self, t: int, split: BatchSplit, next_union: np.ndarray) -> IterationRows:
        start = time.perf_counter()
        block = self.home.exchange_to(self._pending_ids, self._pending_rows, split.mine, self.device)
        self.drop_pending()
        self.stall_seconds += time.perf_counter() - start
        return IterationRows(t, split, next_union, block)

    def update(self, gathered: IterationRows, grad: torch.Tensor, lr: float) -> None:
        apply_update(rule_at(self.spec, lr), gathered.rows, grad)
        start = time.perf_counter()
        self._pending_ids, self._pending_rows = gathered.split.mine, gathered.rows.cpu().numpy()
        self.stall_seconds += time.perf_counter() - start

    def finish(self) -> None:
        self.home.write_back(self._pending_ids, self._pending_rows)
        self.drop_pending()

    def held_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """The pending write-back (sorted ids: a batch's distinct ids)."""
        return self._pending_ids.copy(), np.array(self._pending_rows, dtype=np.float32)

    def traffic(self) -> dict[str, int]:
        """The pending write-back is in :meth:`logical_rows`: counted as written."""
        counts = super().traffic()
        counts["bytes_written"] += len(self._pending_ids) * self.spec.row_bytes
        return counts

    def drop_pending(self) -> None:
        self._pending_ids, self._pending_rows = self._pending_ids[:0], self._pending_rows[:0]


class RemoteRowsW(RowStore):
    """The W-trainer reference: fetch the slice's rows, write each updated row home once, barrier.

    ``gateway`` (a run with parity, whose coded group has one client): trainer 0 alone talks to the
    servers. It fetches the rows of the whole batch and hands each trainer its own; after backward it
    updates and writes every row of the batch (it has every trainer's gradients). The other trainers
    update nothing: their rows are fetched again next time. Its servers hold every row's value after each
    iteration: nothing it keeps is newer, so the checkpoint view and reads are the servers'; a resumed
    trainer counts its traffic from the resume (the checkpoint holds trainer 0's)."""

    def __init__(self, spec: RowSpec, device: torch.device, shards: ShardGroup | None, group: TrainerGroup, *,
                 gateway: bool = False) -> None:
        self.spec, self.device, self.group, self.gateway = spec, device, group, gateway
        self.home = ShardHome(spec, shards)
        self.through = WriteThrough(group, self.home)
        self.stall_seconds = 0.0
        self._gradient_sync = 0.0  # seconds in the row gradients' gather

    @property
    def sync_seconds(self) -> float:
        return self._gradient_sync + self.through.sync_seconds

    def gather(self, t: int, split: BatchSplit, next_union: np.ndarray) -> IterationRows:
        start = time.perf_counter()
        batch_rows = None
        if not self.gateway:
            block = self.home.fetch(split.mine, self.device)
        else:
            lead = self.group.rank == 0
            rows = self.home.fetch(split.union, self.device) if lead else torch.zeros((0, self.spec.width))
            counts = [len(split.union)] + [0] * (split.size - 1)
            rows = self.group.all_gather_rows(rows, counts, "fetched rows")[0]
            batch_rows = rows if lead else None
            block = rows[torch.from_numpy(split.where[split.rank])]
        self.stall_seconds += time.perf_counter() - start
        return IterationRows(t, split, next_union, block.to(self.device), batch_rows=batch_rows)

    def update(self, gathered: IterationRows, grad: torch.Tensor, lr: float) -> None:
        split = gathered.split
        start = time.perf_counter()
        ids, parts = gather_gradients(self.group, split, np.ones(len(split.union), dtype=bool), grad,
                                      "row gradients")
        self._gradient_sync += time.perf_counter() - start
        if self.gateway:
            if self.group.rank == 0:  # every row of the batch, by its one writer
                write, rows = split.union, gathered.batch_rows
            else:
                return
        else:
            write = split.union[split.first_user() == split.rank]
            rows = gathered.rows[torch.from_numpy(np.searchsorted(split.mine, write))]
        apply_update_rowwise(rule_at(self.spec, lr), rows,
                             sum_over_users(write, list(zip(ids, parts, strict=True)), split.size))
        if self.gateway:  # one writer, which also makes every fetch: its calls are in order, no barrier needed
            start = time.perf_counter()
            self.home.write_back(write, rows.numpy())
            self.stall_seconds += time.perf_counter() - start
        else:
            self.stall_seconds += self.through.write(write, rows)  # home before any fetch for t + 1

    def resume_from(self, traffic: dict[str, int], cache: dict[str, np.ndarray] | None, rows: np.ndarray) -> None:
        """Nothing: this trainer counts from the resume, and it caches nothing."""


def make_store(setup: RunSetup, device: torch.device, shards: ShardGroup, group: TrainerGroup, *, start: int = 0,
               rows: np.ndarray | None = None) -> RemoteRows | RemoteRowsW:
    if group.size == 1:
        return RemoteRows(setup.spec, device, shards)
    return RemoteRowsW(setup.spec, device, shards, group, gateway=bool(setup.config.parity))
