"""``lru``: rows on the embedding servers, an on-demand LRU cache of ``capacity`` rows per trainer."""

from __future__ import annotations

import time

import numpy as np
import torch

from dlrmflow.engine.planning.planner import CapacityError
from dlrmflow.engine.serving.embedding_rows import RowSpec
from dlrmflow.engine.serving.shards import ShardGroup
from dlrmflow.engine.training.batch_split import BatchSplit
from dlrmflow.engine.training.collectives import TrainerGroup, sum_over_users
from dlrmflow.engine.training.row_updates import apply_update, apply_update_rowwise
from dlrmflow.engine.training.run_setup import RunSetup
from dlrmflow.engine.training.stores.base import IterationRows, RowStore, rule_at
from dlrmflow.engine.training.stores.homes import ShardHome
from dlrmflow.engine.training.stores.slot_cache import SlotCache
from dlrmflow.engine.training.stores.sync import WriteThrough, gather_gradients


class LruCache:
    """The LRU policy over a :class:`~.slot_cache.SlotCache`: misses are fetched when the iteration needs
    them, the least recently used rows evicted. ``write_back``: an evicted row goes home (False: its
    servers already hold its value, write-through, and it is dropped)."""

    def __init__(self, cache: SlotCache, capacity: int, *, write_back: bool = True) -> None:
        if capacity < 1:
            raise CapacityError(f"the LRU cache needs a capacity of at least 1 row, got {capacity}")
        self.cache, self.capacity, self.write_back = cache, capacity, write_back
        self.last_used = np.full(capacity, -1, dtype=np.int64)

    def _victims(self, t: int, count: int) -> np.ndarray:
        """The ``count`` least recently used occupied slots that iteration ``t`` does not use.

        Ties (same last use) go to the lowest slot, so the choice is deterministic."""
        candidate = (self.cache.directory.owner >= 0) & (self.last_used < t)
        # One key per slot: (last use, slot); non-candidates sort last.
        order_key = (self.last_used + 1) * self.capacity + np.arange(self.capacity)
        key = np.where(candidate, order_key, np.iinfo(np.int64).max)
        if count < self.capacity:
            chosen = np.argpartition(key, count - 1)[:count]
        else:
            chosen = np.arange(self.capacity)
        return chosen[np.argsort(key[chosen])]

    def slots_for(self, t: int, ids: np.ndarray) -> np.ndarray:
        """The slots of ``ids`` (sorted) for iteration ``t``, the misses fetched first."""
        if len(ids) > self.capacity:
            raise CapacityError(
                f"iteration {t} uses {len(ids)} distinct rows but the LRU cache holds only {self.capacity}"
            )
        directory = self.cache.directory
        slots = directory.lookup(ids)
        hit = slots >= 0
        self.last_used[slots[hit]] = t
        miss_ids = ids[~hit]
        if len(miss_ids):
            free = np.flatnonzero(directory.owner < 0)
            victim_ids = victims = ids[:0]
            if len(free) < len(miss_ids):
                victims = self._victims(t, len(miss_ids) - len(free))  # in LRU order
                victim_ids = directory.owner[victims]
                free = np.concatenate([free, victims])
            new_slots = free[: len(miss_ids)]
            # Evicted rows go home and misses come in, in one round trip (they are distinct rows).
            if self.write_back:
                self.cache.exchange(victim_ids, victims, miss_ids, new_slots)
            else:
                self.cache.exchange(victim_ids[:0], victims[:0], miss_ids, new_slots)
            directory.remove(victim_ids)
            directory.place(miss_ids, new_slots)
            self.last_used[new_slots] = t
            slots = directory.lookup(ids)
        return slots

    def gather(self, t: int, split: BatchSplit, next_union: np.ndarray) -> tuple[IterationRows, float]:
        """Iteration ``t``'s rows of this trainer (``split.mine``), and the seconds spent fetching its misses."""
        start = time.perf_counter()
        slots = self.slots_for(t, split.mine)
        waited = time.perf_counter() - start
        index = self.cache.index(slots)
        return IterationRows(t, split, next_union, self.cache.rows.index_select(0, index), slots=index), waited

    def clear(self) -> None:
        self.cache.empty()
        self.last_used[:] = -1

    def state(self) -> dict[str, np.ndarray]:
        """The id in every slot (-1: free) and every slot's last use: with them a resumed run makes the
        uninterrupted run's hits, misses and evictions, so its traffic totals are the same."""
        return {"owner": self.cache.directory.owner.copy(), "last_used": self.last_used.copy()}

    def restore(self, state: dict[str, np.ndarray] | None, rows: np.ndarray) -> None:
        """Cache again the rows of ``state`` (:meth:`state`), their values from ``rows``."""
        if state is None:
            return
        owner, last_used = np.asarray(state["owner"], dtype=np.int64), np.asarray(state["last_used"], np.int64)
        if owner.shape != (self.capacity,) or last_used.shape != (self.capacity,):
            raise ValueError(f"the checkpoint's cache has {len(owner)} slots, this LRU cache {self.capacity}")
        slots = np.flatnonzero(owner >= 0)
        ids = owner[slots]
        self.cache.directory.place(ids, slots)
        held = np.ascontiguousarray(rows[ids])
        self.cache.load(slots, held)
        self.cache.home.held_by_trainer(ids, held)  # with parity: the old rows of their first write-backs
        self.last_used[:] = last_used


class LruRows(RowStore):
    """One trainer's on-demand LRU cache in front of the shards."""

    def __init__(self, spec: RowSpec, device: torch.device, shards: ShardGroup, capacity: int) -> None:
        self.spec, self.device = spec, device
        self.home = ShardHome(spec, shards)
        self.cache = SlotCache(spec, device, self.home, capacity)
        self.lru = LruCache(self.cache, capacity)
        self.stall_seconds = 0.0

    @property
    def peak_cached_rows(self) -> int:
        return self.cache.peak

    def gather(self, t: int, split: BatchSplit, next_union: np.ndarray) -> IterationRows:
        gathered, waited = self.lru.gather(t, split, next_union)
        self.stall_seconds += waited
        return gathered

    def update(self, gathered: IterationRows, grad: torch.Tensor, lr: float) -> None:
        apply_update(rule_at(self.spec, lr), gathered.rows, grad)
        self.cache.rows.index_copy_(0, gathered.slots, gathered.rows)

    def finish(self) -> None:
        self.cache.write_back(self.cache.directory.cached_ids())

    def held_rows(self) -> tuple[np.ndarray, np.ndarray]:
        return self.cache.held()

    def drop_pending(self) -> None:
        self.lru.clear()

    def cache_state(self) -> dict[str, np.ndarray]:
        return self.lru.state()

    def restore_cache(self, state: dict[str, np.ndarray] | None, rows: np.ndarray) -> None:
        self.lru.restore(state, rows)


class LruRowsW(RowStore):
    """Independent per-trainer LRU caches kept coherent by update and write-through: every trainer applies
    every gradient of the rows it caches, and each row's lowest user writes it home in its iteration, so an
    evicted row is dropped, never written back (its servers are current)."""

    def __init__(self, spec: RowSpec, device: torch.device, shards: ShardGroup, group: TrainerGroup,
                 capacity: int) -> None:
        self.spec, self.device, self.group = spec, device, group
        self.home = ShardHome(spec, shards)
        self.cache = SlotCache(spec, device, self.home, capacity)
        self.lru = LruCache(self.cache, capacity, write_back=False)
        self.through = WriteThrough(group, self.home)
        self.stall_seconds = 0.0
        self._gradient_sync = 0.0

    @property
    def sync_seconds(self) -> float:
        return self._gradient_sync + self.through.sync_seconds

    @property
    def peak_cached_rows(self) -> int:
        return self.cache.peak

    def gather(self, t: int, split: BatchSplit, next_union: np.ndarray) -> IterationRows:
        gathered, waited = self.lru.gather(t, split, next_union)
        self.stall_seconds += waited
        return gathered

    def update(self, gathered: IterationRows, grad: torch.Tensor, lr: float) -> None:
        split = gathered.split
        start = time.perf_counter()
        ids, parts = gather_gradients(self.group, split, np.ones(len(split.union), dtype=bool), grad,
                                      "row gradients")
        self._gradient_sync += time.perf_counter() - start
        directory = self.cache.directory
        held = split.union[directory.lookup(split.union) >= 0]  # every row here that some trainer used at t
        slots = self.cache.index(directory.lookup(held))
        rows = self.cache.rows.index_select(0, slots)
        apply_update_rowwise(rule_at(self.spec, lr), rows,
                             sum_over_users(held, list(zip(ids, parts, strict=True)), split.size))
        self.cache.rows.index_copy_(0, slots, rows)
        write = split.union[split.first_user() == split.rank]
        # Home before any trainer misses on the row at t + 1.
        self.stall_seconds += self.through.write(write, rows[torch.from_numpy(np.searchsorted(held, write))])

    def resume_from(self, traffic: dict[str, int], cache: dict[str, np.ndarray] | None, rows: np.ndarray) -> None:
        """Nothing: this trainer counts from the resume and starts with nothing cached (a cached copy equals
        its server's, so the bits do not change; the misses do)."""


def make_store(setup: RunSetup, device: torch.device, shards: ShardGroup, group: TrainerGroup, *, start: int = 0,
               rows: np.ndarray | None = None) -> LruRows | LruRowsW:
    if group.size == 1:
        return LruRows(setup.spec, device, shards, setup.config.capacity)
    return LruRowsW(setup.spec, device, shards, group, setup.config.capacity)
