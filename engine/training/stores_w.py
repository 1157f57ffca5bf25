"""Row stores for W data-parallel trainers: each trainer trains its 1/W slice of every global batch.

All three modes end in the same bits (the reference is ``remote``), because in every one of them:

- a row's gradient at iteration ``t`` is the sum, in rank order, of the gradients of the trainers
  whose slice uses it, divided by W (:func:`~dlrmflow.engine.training.collectives.sum_over_users`);
- a row is updated with :func:`~dlrmflow.engine.serving.embedding_rows.apply_update_rowwise`, whose result
  for a row does not depend on which other rows share its block;
- every copy of a row that is read again holds every update before that read.

What each trainer holds and who talks to the servers differs:

``remote`` (:class:`RemoteRowsW`, the reference): every trainer fetches the rows of its slice, and
after the step the lowest-ranked trainer that used a row writes it home; a barrier then orders
every write of ``t`` before any fetch for ``t + 1``.

``lru`` (:class:`LruRowsW`): independent per-trainer LRU caches. They stay coherent by update:
every trainer applies the summed gradient of every row it holds that any trainer used, and the
lowest-ranked user writes the row through to its server, so the servers are current after each
iteration's barrier and a miss may read them. Server reads grow with W (each trainer misses on
its own); writes equal ``remote``'s.

``oracle`` (:class:`LrppRows`, Bagpipe's logically replicated, physically partitioned cache): one
plan for the global batch, and every trainer holds the same cache slots. Each prefetched row is
fetched from its server by one trainer and handed to the others over the trainer group (so server
reads do not grow with W); each evicted row is written home by one trainer. After the step a row
used at ``t`` is, by Bagpipe's classes:

- ``no_sync``: used by one trainer and evicted after ``t``: that trainer updates it and writes it
  home; no other copy is read again;
- ``sync_now``: used at ``t + 1`` or evicted after ``t``: its gradients are gathered before
  ``t + 1`` starts and every trainer updates its copy;
- ``sync_later``: kept for a use at ``t + 2`` or later: its gradients are gathered while ``t + 1``
  computes and applied at the end of ``t + 1``. A read of a row whose gradient is still in flight
  is refused (:class:`~dlrmflow.engine.training.prefetch.PlanViolation`), never served stale.

Who fetches and who writes. A row's writer at eviction is its only user (``no_sync``), else trainer
``id % W``; its next fetch goes to the trainer that last wrote it home (``id % W`` before any
write). A trainer's write and its own later fetch of the row go to the same server in order, so no
fetch can overtake the write it must see, whatever the other trainers' timing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from dlrmflow.engine.serving.embedding_rows import RowSpec, apply_update_rowwise
from dlrmflow.engine.serving.shards import ShardGroup
from dlrmflow.engine.training.collectives import PendingGather, TrainerGroup, sum_over_users
from dlrmflow.engine.training.prefetch import EMPTY_IDS, Done, PartitionedPrefetchWorker, PlanViolation, PrefetchWorker
from dlrmflow.engine.training.stores import LruRows, OracleRows, host_buffer


@dataclass
class BatchSplit:
    """Iteration ``t``'s global batch as the W trainers see it (every trainer computes the same one)."""

    t: int
    rank: int
    union: np.ndarray  # sorted distinct ids of the whole global batch
    uniq: list[np.ndarray]  # trainer w's sorted distinct ids
    where: list[np.ndarray]  # positions of uniq[w] in union
    users: np.ndarray  # [W, len(union)] bool: trainer w's slice uses union[i]
    inverse: np.ndarray  # this trainer's slice, flattened: index into uniq[rank] per id

    @classmethod
    def of(cls, t: int, ids: np.ndarray, size: int, rank: int) -> BatchSplit:
        """``ids``: the global batch's ids ``[B, T]``; trainer w takes rows ``w*B/W .. (w+1)*B/W - 1``.

        One sort of the whole batch: each slice's distinct ids are the union's ids its rows point at."""
        rows = ids.shape[0] // size
        union, inverse = np.unique(ids, return_inverse=True)
        inverse = inverse.reshape(ids.shape)
        users = np.zeros((size, len(union)), dtype=bool)
        uniq, where = [], []
        for w in range(size):
            users[w, inverse[w * rows:(w + 1) * rows]] = True
            where.append(np.flatnonzero(users[w]))
            uniq.append(union[where[-1]])
        # This trainer's slice: positions in the union -> positions among its own distinct ids.
        rank_of = np.cumsum(users[rank]) - 1
        mine = rank_of[inverse[rank * rows:(rank + 1) * rows].reshape(-1)]
        return cls(t, rank, union, uniq, where, users, mine)

    @property
    def size(self) -> int:
        return len(self.uniq)

    @property
    def mine(self) -> np.ndarray:
        return self.uniq[self.rank]

    def first_user(self) -> np.ndarray:
        """Per id of the union: the lowest rank whose slice uses it."""
        return np.argmax(self.users, axis=0)

    def held(self, mask: np.ndarray) -> list[np.ndarray]:
        """Per trainer, its ids that ``mask`` (over the union) selects."""
        return [ids_w[mask[where_w]] for ids_w, where_w in zip(self.uniq, self.where, strict=True)]


def sync_classes(split: BatchSplit, next_union: np.ndarray, evict: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Bagpipe's classes of the rows iteration ``t`` used, as masks over ``split.union``: ``(no_sync,
    sync_now, sync_later)`` for the plan's evictions after ``t`` (``evict``, sorted) and the next
    iteration's ids (``next_union``, sorted). See the module docstring."""
    evicted = np.isin(split.union, evict, assume_unique=True)
    if np.count_nonzero(evicted) != len(evict):
        raise PlanViolation(f"iteration {split.t}: the plan evicts a row the batch does not use")
    no_sync = (split.users.sum(axis=0) == 1) & evicted
    now = ~no_sync & (evicted | np.isin(split.union, next_union, assume_unique=True))
    return no_sync, now, ~no_sync & ~now


class RowsForTrainers:
    """What every W-trainer store shares: the trainer group, its counters, gradient gathering."""

    def __init__(self, spec: RowSpec, group: TrainerGroup) -> None:
        self.group = group
        self.sync_seconds = 0.0  # time in the row gradients' collectives (and the remote modes' barrier)

    def _gather_gradients(self, split: BatchSplit, mask: np.ndarray, grad: torch.Tensor, kind: str, *,
                          async_op: bool = False) -> tuple[list[np.ndarray], list | PendingGather]:
        """Every trainer's gradients of its rows that ``mask`` selects: (ids per trainer, rows per trainer)."""
        ids = split.held(mask)
        mine = mask[split.where[split.rank]]
        rows = grad[torch.from_numpy(np.flatnonzero(mine))]
        gathered = self.group.all_gather_rows(rows, [len(i) for i in ids], kind, async_op=async_op)
        return ids, gathered


class ServersCurrentRows(RowsForTrainers):
    """A W-trainer store whose servers hold every row's value after each iteration (nothing it keeps is newer):
    its checkpoint view and its reads are the servers'."""

    spec: RowSpec
    device: torch.device
    shards: ShardGroup

    def quiesce(self) -> None:
        """Nothing to wait for: every write went home in its iteration."""

    def finish(self) -> None:
        """Nothing to write: every write went home in its iteration."""

    def read(self, ids: np.ndarray) -> torch.Tensor:
        host = host_buffer(len(ids), self.spec.width, self.device)
        self.shards.fetch(ids, out=host.numpy())
        return host.to(self.device)

    def all_rows(self) -> np.ndarray:
        return self.shards.all_rows()

    logical_rows = all_rows

    def traffic(self) -> dict[str, int]:
        return {"bytes_fetched": int(self.bytes_fetched), "bytes_written": int(self.bytes_written)}

    def cache_state(self) -> None:
        """None: a resumed trainer starts with nothing cached (a cached copy equals its server's, so the bits
        do not change; an LRU cache's misses do)."""
        return None

    def _write_through(self, ids: np.ndarray, rows: torch.Tensor) -> float:
        """Write ``rows`` home, then wait until every trainer's writes of this iteration are home, so that no
        trainer reads a server before them; returns the seconds spent writing (the barrier counts as sync)."""
        start = time.perf_counter()
        self.shards.write_back(ids, rows.numpy())
        written = time.perf_counter()
        self.group.barrier()
        self.sync_seconds += time.perf_counter() - written
        return written - start


class RemoteRowsW(ServersCurrentRows):
    """The W-trainer reference: fetch the slice's rows, write each updated row home once, barrier.

    ``gateway`` (a run with parity, whose coded group has one client): trainer 0 alone talks to the
    servers. It fetches the rows of the whole batch and hands each trainer its own; after the step it
    updates and writes every row of the batch (it has every trainer's gradients). The other trainers
    update nothing: their rows are fetched again next time."""

    def __init__(self, spec: RowSpec, device: torch.device, shards: ShardGroup | None, group: TrainerGroup, *,
                 gateway: bool = False) -> None:
        super().__init__(spec, group)
        self.spec, self.device, self.shards, self.gateway = spec, device, shards, gateway
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
        apply_update_rowwise(self.spec, rows, sum_over_users(write, list(zip(ids, parts, strict=True)), split.size))
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


class _CleanLruRows(LruRows):
    """An LRU cache whose rows are never newer than their servers' (write-through): an evicted row is
    dropped, not written back."""

    def _exchange_slots(self, write_ids, write_slots, fetch_ids, fetch_slots) -> None:
        super()._exchange_slots(write_ids[:0], write_slots[:0], fetch_ids, fetch_slots)

    def finish(self) -> None:
        """Nothing cached is newer than its server."""


class LruRowsW(ServersCurrentRows):
    """Independent per-trainer LRU caches kept coherent by update and write-through (module docstring)."""

    def __init__(self, spec: RowSpec, device: torch.device, shards: ShardGroup, group: TrainerGroup,
                 capacity: int) -> None:
        super().__init__(spec, group)
        self.lru = _CleanLruRows(spec, device, shards, capacity)
        self.spec, self.device, self.shards = spec, device, shards
        self._written = 0
        self._write_stall = 0.0

    @property
    def bytes_fetched(self) -> int:
        return self.lru.bytes_fetched

    @property
    def bytes_written(self) -> int:
        return self._written

    @property
    def stall_seconds(self) -> float:
        return self.lru.stall_seconds + self._write_stall

    def gather(self, t: int, split: BatchSplit) -> torch.Tensor:
        return self.lru.gather(t, split.mine)

    def update(self, t: int, split: BatchSplit, next_union: np.ndarray, block: torch.Tensor,
               grad: torch.Tensor) -> None:
        start = time.perf_counter()
        ids, parts = self._gather_gradients(split, np.ones(len(split.union), dtype=bool), grad, "row gradients")
        self.sync_seconds += time.perf_counter() - start
        directory = self.lru.directory
        held = split.union[directory.slot_of[split.union] >= 0]  # every row here that some trainer used at t
        slots = torch.from_numpy(directory.slot_of[held]).to(self.device)
        rows = self.lru.cache.index_select(0, slots)
        apply_update_rowwise(self.spec, rows, sum_over_users(held, list(zip(ids, parts, strict=True)), split.size))
        self.lru.cache.index_copy_(0, slots, rows)
        write = split.union[split.first_user() == split.rank]
        self._written += len(write) * self.spec.row_bytes
        # Home before any trainer misses on the row at t + 1.
        self._write_stall += self._write_through(write, rows[torch.from_numpy(np.searchsorted(held, write))])

    def close(self) -> None:
        self.lru.close()


class LrppRows(OracleRows, RowsForTrainers):
    """Bagpipe's LRPP cache for one of W trainers (module docstring).

    ``gateway`` (a run with parity, whose coded group has one client): trainer 0 fetches and writes
    every row, so no row is ``no_sync`` (trainer 0's copy of every row must be current).
    ``start``/``rows``: a resumed run, as :class:`~dlrmflow.engine.training.stores.OracleRows`."""

    def __init__(self, spec: RowSpec, device: torch.device, shards: ShardGroup | None, group: TrainerGroup, plan,
                 iterations: int, *, gateway: bool = False, start: int = 0, rows: np.ndarray | None = None) -> None:
        RowsForTrainers.__init__(self, spec, group)
        self.gateway = gateway
        self.in_flight = np.zeros(spec.total_rows, dtype=bool)  # rows whose sync_later gradient is not applied
        self._later: tuple[np.ndarray, list[np.ndarray], PendingGather] | None = None
        OracleRows.__init__(self, spec, device, shards, plan, iterations, start=start, rows=rows)

    def make_worker(self, t: int, ids: np.ndarray, slots: np.ndarray) -> PrefetchWorker:
        return PartitionedPrefetchWorker(
            self.plan.iterations(t), self.iterations, self.plan.config.prefetch_distance, self.cache, self.shards,
            self.spec.total_rows, start=t, cached=(ids, slots), group=self.group, gateway=self.gateway)

    def quiesce(self) -> None:
        """Before a checkpoint (every trainer calls it, then a barrier): the gradients in flight applied,
        every posted eviction home and no round trip in flight."""
        self._apply_later()
        self.worker.wait_idle()

    def gather(self, t: int, split: BatchSplit) -> torch.Tensor:
        stale = self.in_flight[split.union]
        if stale.any():
            raise PlanViolation(f"iteration {t}: id {int(split.union[stale][0])} is read while its gradient "
                                "from an earlier iteration is still being synced (a stale read)")
        return OracleRows.gather(self, t, split.mine)

    def _update_rows(self, ids: np.ndarray, parts: list[tuple[np.ndarray, torch.Tensor]], size: int) -> None:
        if not len(ids):
            return
        slots = torch.from_numpy(self.directory.slot_of[ids]).to(self.device)
        rows = self.cache.index_select(0, slots)
        apply_update_rowwise(self.spec, rows, sum_over_users(ids, parts, size))
        self.cache.index_copy_(0, slots, rows)

    def _apply_later(self) -> None:
        """Wait for the sync_later gradients in flight and update those rows."""
        if self._later is None:
            return
        ids, held, pending = self._later
        start = time.perf_counter()
        parts = pending.wait()
        self.sync_seconds += time.perf_counter() - start
        self._update_rows(ids, list(zip(held, parts, strict=True)), self.group.size)
        self.in_flight[ids] = False
        self._later = None

    def update(self, t: int, split: BatchSplit, next_union: np.ndarray, block: torch.Tensor,
               grad: torch.Tensor) -> None:
        union, size = split.union, split.size
        evict = np.asarray(self._step.evict_ids, dtype=np.int64)
        no_sync, now, later = sync_classes(split, next_union, evict)
        if self.gateway:  # trainer 0 writes every row home: it needs every gradient
            now, no_sync = now | no_sync, no_sync & False

        start = time.perf_counter()
        ids, parts = self._gather_gradients(split, now, grad, "sync_now")
        self.sync_seconds += time.perf_counter() - start
        self._update_rows(union[now], list(zip(ids, parts, strict=True)), size)
        own = no_sync & split.users[split.rank]
        own_grad = grad[torch.from_numpy(np.flatnonzero(own[split.where[split.rank]]))]
        self._update_rows(union[own], [(union[own], own_grad)], size)
        self._apply_later()  # the previous iteration's: none of its rows is used at t or t + 1
        ids, pending = self._gather_gradients(split, later, grad, "sync_later", async_op=True)
        self._later = (union[later], ids, pending)
        self.in_flight[union[later]] = True

        evicted = np.isin(union, evict, assume_unique=True)
        single = split.users.sum(axis=0) == 1
        writers = np.zeros(len(evict), dtype=np.int64) if self.gateway else \
            np.where(single, split.first_user(), union % size)[evicted]
        evict_slots = self.directory.slot_of[evict]
        if (evict_slots < 0).any():
            raise PlanViolation(f"iteration {t}: the plan evicts id {int(evict[evict_slots < 0][0])}, which is "
                                "not cached")
        self.directory.remove(evict)
        self.worker.post_done(Done(t, evict, evict_slots, None, writers))

    def _write_back_all(self) -> None:
        """Every cached row home, each by trainer ``id % W`` (all trainers hold the same rows; ``gateway``:
        trainer 0)."""
        ids = self.directory.cached_ids()
        owner = np.zeros(len(ids), dtype=np.int64) if self.gateway else ids % self.group.size
        share = ids[owner == self.group.rank]
        self._exchange_slots(share, self.directory.slot_of[share], EMPTY_IDS, EMPTY_IDS)
        self.directory.remove(ids)

    def finish(self) -> None:
        self._apply_later()
        OracleRows.finish(self)
