"""``remote``: rows on the embedding servers, no cache: the parameter-server baseline, and with several
trainers the W-trainer reference (docs/trainers.md)."""

from __future__ import annotations

import time

import numpy as np
import torch

from dlrmflow.engine.serving.embedding_rows import RowSpec, apply_update_rowwise
from dlrmflow.engine.serving.shards import ShardGroup
from dlrmflow.engine.training.batch_split import BatchSplit
from dlrmflow.engine.training.collectives import TrainerGroup, sum_over_users
from dlrmflow.engine.training.run_setup import RunSetup
from dlrmflow.engine.training.stores.base import ServersCurrentRows, ShardRows, host_buffer


class RemoteRows(ShardRows):
    """Every iteration: fetch all its rows, train, write them all back.

    The write-back of iteration ``t`` travels in the same round trip as the fetch of ``t + 1``
    (each shard applies the write first), so a row is never read stale and each iteration costs
    one round trip per shard; the last write-back happens in :meth:`finish`."""

    def __init__(self, spec: RowSpec, device: torch.device, shards: ShardGroup) -> None:
        super().__init__(spec, device, shards)
        self._pending_ids = np.zeros(0, dtype=np.int64)
        self._pending_rows = np.zeros((0, spec.width), dtype=np.float32)

    def _fetch(self, ids: np.ndarray, write_ids: np.ndarray, write_rows: np.ndarray) -> torch.Tensor:
        host = host_buffer(len(ids), self.spec.width, self.device)
        self.shards.exchange(write_ids, write_rows, ids, out=host.numpy())
        return host.to(self.device)

    def gather_ids(self, t: int, ids: np.ndarray) -> torch.Tensor:
        start = time.perf_counter()
        block = self._fetch(ids, self._pending_ids, self._pending_rows)
        self.bytes_written += len(self._pending_ids) * self.spec.row_bytes
        self.bytes_fetched += len(ids) * self.spec.row_bytes
        self._pending_ids, self._pending_rows = ids[:0], self._pending_rows[:0]
        self.stall_seconds += time.perf_counter() - start
        return block

    def scatter(self, t: int, ids: np.ndarray, block: torch.Tensor) -> None:
        start = time.perf_counter()
        self._pending_ids, self._pending_rows = ids, block.cpu().numpy()
        self.stall_seconds += time.perf_counter() - start

    def finish(self) -> None:
        self.shards.write_back(self._pending_ids, self._pending_rows)
        self.bytes_written += len(self._pending_ids) * self.spec.row_bytes
        self._pending_ids, self._pending_rows = self._pending_ids[:0], self._pending_rows[:0]

    def read(self, ids: np.ndarray) -> torch.Tensor:
        return self._fetch(ids, self._pending_ids[:0], self._pending_rows[:0])

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


class RemoteRowsW(ServersCurrentRows):
    """The W-trainer reference: fetch the slice's rows, write each updated row home once, barrier.

    ``gateway`` (a run with parity, whose coded group has one client): trainer 0 alone talks to the
    servers. It fetches the rows of the whole batch and hands each trainer its own; after the step it
    updates and writes every row of the batch (it has every trainer's gradients). The other trainers
    update nothing: their rows are fetched again next time."""

    def __init__(self, spec: RowSpec, device: torch.device, shards: ShardGroup | None, group: TrainerGroup, *,
                 gateway: bool = False) -> None:
        super().__init__(spec, device, group)
        self.shards, self.gateway = shards, gateway
        self.bytes_fetched = self.bytes_written = 0
        self.stall_seconds = 0.0
        self._batch_rows: torch.Tensor | None = None  # gateway, trainer 0: the whole batch's rows

    def gather(self, t: int, split: BatchSplit) -> torch.Tensor:
        start = time.perf_counter()
        if not self.gateway:
            block = self._fetch(split.mine)
        else:
            lead = self.group.rank == 0
            rows = self._fetch(split.union) if lead else torch.zeros((0, self.spec.width))
            counts = [len(split.union)] + [0] * (split.size - 1)
            rows = self.group.all_gather_rows(rows, counts, "fetched rows")[0]
            self._batch_rows = rows if lead else None
            block = rows[torch.from_numpy(split.where[split.rank])]
        self.stall_seconds += time.perf_counter() - start
        return block.to(self.device)

    def _fetch(self, ids: np.ndarray) -> torch.Tensor:
        host = host_buffer(len(ids), self.spec.width, self.device)
        self.shards.fetch(ids, out=host.numpy())
        self.bytes_fetched += len(ids) * self.spec.row_bytes
        return host

    def update(self, t: int, split: BatchSplit, next_union: np.ndarray, block: torch.Tensor,
               grad: torch.Tensor) -> None:
        start = time.perf_counter()
        ids, parts = self._gather_gradients(split, np.ones(len(split.union), dtype=bool), grad, "row gradients")
        self.sync_seconds += time.perf_counter() - start
        if self.gateway:
            if self.group.rank == 0:  # every row of the batch, by its one writer
                write, rows = split.union, self._batch_rows
            else:
                return
        else:
            write = split.union[split.first_user() == split.rank]
            rows = block[torch.from_numpy(np.searchsorted(split.mine, write))]
        apply_update_rowwise(self.spec_at(t), rows,
                             sum_over_users(write, list(zip(ids, parts, strict=True)), split.size))
        self.bytes_written += len(write) * self.spec.row_bytes
        if self.gateway:  # one writer, which also makes every fetch: its calls are in order, no barrier needed
            start = time.perf_counter()
            self.shards.write_back(write, rows.numpy())
            self.stall_seconds += time.perf_counter() - start
        else:
            self.stall_seconds += self._write_through(write, rows)  # home before any fetch for t + 1

    def close(self) -> None:
        if self.shards is not None:
            self.shards.close()


def make_store(setup: RunSetup, device: torch.device, shards: ShardGroup, group: TrainerGroup, *, start: int = 0,
               rows: np.ndarray | None = None) -> RemoteRows | RemoteRowsW:
    if group.size == 1:
        return RemoteRows(setup.spec, device, shards)
    return RemoteRowsW(setup.spec, device, shards, group, gateway=bool(setup.config.parity))
