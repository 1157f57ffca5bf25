"""``lru``: rows on the embedding servers, an on-demand LRU cache of ``capacity`` rows per trainer."""

from __future__ import annotations

import time

import numpy as np
import torch

from dlrmflow.engine.planning.planner import CapacityError
from dlrmflow.engine.serving.embedding_rows import RowSpec, apply_update_rowwise
from dlrmflow.engine.serving.shards import ShardGroup
from dlrmflow.engine.training.batch_split import BatchSplit
from dlrmflow.engine.training.collectives import TrainerGroup, sum_over_users
from dlrmflow.engine.training.run_setup import RunSetup
from dlrmflow.engine.training.stores.base import CachedRows, ServersCurrentRows


class LruRows(CachedRows):
    """On-demand cache: misses are fetched when the iteration needs them, LRU rows evicted."""

    def __init__(self, spec: RowSpec, device: torch.device, shards: ShardGroup, capacity: int) -> None:
        if capacity < 1:
            raise CapacityError(f"the LRU cache needs a capacity of at least 1 row, got {capacity}")
        super().__init__(spec, device, shards, capacity)
        self.capacity = capacity
        self.last_used = np.full(capacity, -1, dtype=np.int64)

    def _victims(self, t: int, count: int) -> np.ndarray:
        """The ``count`` least recently used occupied slots that iteration ``t`` does not use.

        Ties (same last use) go to the lowest slot, so the choice is deterministic."""
        candidate = (self.directory.owner >= 0) & (self.last_used < t)
        # One key per slot: (last use, slot); non-candidates sort last.
        order_key = (self.last_used + 1) * self.capacity + np.arange(self.capacity)
        key = np.where(candidate, order_key, np.iinfo(np.int64).max)
        if count < self.capacity:
            chosen = np.argpartition(key, count - 1)[:count]
        else:
            chosen = np.arange(self.capacity)
        return chosen[np.argsort(key[chosen])]

    def gather_ids(self, t: int, ids: np.ndarray) -> torch.Tensor:
        if len(ids) > self.capacity:
            raise CapacityError(
                f"iteration {t} uses {len(ids)} distinct rows but the LRU cache holds only {self.capacity}"
            )
        start = time.perf_counter()
        slots = self.directory.slot_of[ids]
        hit = slots >= 0
        self.last_used[slots[hit]] = t
        miss_ids = ids[~hit]
        if len(miss_ids):
            free = np.flatnonzero(self.directory.owner < 0)
            victim_ids = victims = ids[:0]
            if len(free) < len(miss_ids):
                victims = self._victims(t, len(miss_ids) - len(free))  # in LRU order
                victim_ids = self.directory.owner[victims]
                free = np.concatenate([free, victims])
            new_slots = free[: len(miss_ids)]
            # Evicted rows go home and misses come in, in one round trip (they are distinct rows).
            self._exchange_slots(victim_ids, victims, miss_ids, new_slots)
            self.directory.remove(victim_ids)
            self.directory.place(miss_ids, new_slots)
            self.last_used[new_slots] = t
            slots = self.directory.slot_of[ids]
        self.stall_seconds += time.perf_counter() - start
        self._slots = torch.from_numpy(slots).to(self.device)
        return self.cache.index_select(0, self._slots)

    def finish(self) -> None:
        self._write_back_all()

    def drop_pending(self) -> None:
        self._empty_cache()
        self.last_used[:] = -1

    def cache_state(self) -> dict[str, np.ndarray]:
        """The id in every slot (-1: free) and every slot's last use: with them a resumed run makes the
        uninterrupted run's hits, misses and evictions, so its traffic totals are the same."""
        return {"owner": self.directory.owner.copy(), "last_used": self.last_used.copy()}

    def restore_cache(self, state: dict[str, np.ndarray] | None, rows: np.ndarray) -> None:
        if state is None:
            return
        owner, last_used = np.asarray(state["owner"], dtype=np.int64), np.asarray(state["last_used"], np.int64)
        if owner.shape != (self.capacity,) or last_used.shape != (self.capacity,):
            raise ValueError(f"the checkpoint's cache has {len(owner)} slots, this LRU cache {self.capacity}")
        slots = np.flatnonzero(owner >= 0)
        ids = owner[slots]
        self.directory.place(ids, slots)
        held = np.ascontiguousarray(rows[ids])
        self.cache.index_copy_(0, torch.from_numpy(slots).to(self.device), torch.from_numpy(held).to(self.device))
        self.shards.held_by_trainer(ids, held)  # with parity: the old rows of their first write-backs
        self.last_used[:] = last_used


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
        super().__init__(spec, device, group)
        self.lru = _CleanLruRows(spec, device, shards, capacity)
        self.shards = shards
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

    @property
    def peak_cached_rows(self) -> int:
        return self.lru.peak_cached_rows

    def gather(self, t: int, split: BatchSplit) -> torch.Tensor:
        return self.lru.gather_ids(t, split.mine)

    def update(self, t: int, split: BatchSplit, next_union: np.ndarray, block: torch.Tensor,
               grad: torch.Tensor) -> None:
        start = time.perf_counter()
        ids, parts = self._gather_gradients(split, np.ones(len(split.union), dtype=bool), grad, "row gradients")
        self.sync_seconds += time.perf_counter() - start
        directory = self.lru.directory
        held = split.union[directory.slot_of[split.union] >= 0]  # every row here that some trainer used at t
        slots = torch.from_numpy(directory.slot_of[held]).to(self.device)
        rows = self.lru.cache.index_select(0, slots)
        apply_update_rowwise(self.spec_at(t), rows,
                             sum_over_users(held, list(zip(ids, parts, strict=True)), split.size))
        self.lru.cache.index_copy_(0, slots, rows)
        write = split.union[split.first_user() == split.rank]
        self._written += len(write) * self.spec.row_bytes
        # Home before any trainer misses on the row at t + 1.
        self._write_stall += self._write_through(write, rows[torch.from_numpy(np.searchsorted(held, write))])

    def close(self) -> None:
        self.lru.close()


def make_store(setup: RunSetup, device: torch.device, shards: ShardGroup, group: TrainerGroup, *, start: int = 0,
               rows: np.ndarray | None = None) -> LruRows | LruRowsW:
    if group.size == 1:
        return LruRows(setup.spec, device, shards, setup.config.capacity)
    return LruRowsW(setup.spec, device, shards, group, setup.config.capacity)
