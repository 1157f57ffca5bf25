"""Where the embedding rows live during training: one row store per trainer mode.

Every store answers the same two calls per iteration ``t``:

- ``gather(t, ids)``: the rows of the batch's distinct ids (sorted) as a fresh ``[U, width]``
  tensor on the training device;
- ``scatter(t, ids, block)``: take the updated block back.

The trainer does everything else (forward, backward, the row update) with one code path, so
modes can differ only in where rows are kept and how they move. That is what makes every
mode bit-identical to ``local``.

- :class:`LocalRows`: the whole table in the trainer's memory (the reference).
- :class:`RemoteRows`: no cache; each iteration fetches its rows from the shards and writes
  them back before the next (the parameter-server baseline).
- :class:`LruRows`: an on-demand cache of ``capacity`` rows, least-recently-used eviction at
  iteration granularity (ties: lowest slot), write-back on eviction.
- :class:`OracleRows`: executes a lookahead plan: a background worker prefetches ``P``
  iterations ahead and writes back evictions while compute runs (see :mod:`.prefetch`).

All stores count the bytes they fetch and write back and the seconds compute waited on
embedding traffic (``stall_seconds``).

The checkpoint view. A checkpoint (:mod:`.checkpoint`) asks each store, through the same calls
whatever the mode, for:

- :meth:`RowStore.logical_rows`: every row's value as the home (table or shards) would hold it
  once every write the store still holds has landed;
- :meth:`RowStore.traffic`: the bytes moved so far, counted as an uninterrupted run counts them;
- :meth:`RowStore.restart_at`: continue at iteration ``t`` from a checkpoint's rows, after
  :meth:`RowStore.drop_pending` forgot what the store held and :meth:`ShardRows.replace_shards`
  swapped in shards restored from the checkpoint.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from dlrmflow.engine.planning.planner import CapacityError
from dlrmflow.engine.serving.embedding_rows import INIT_CHUNK_ROWS, RowSpec, init_rows
from dlrmflow.engine.serving.shards import ShardGroup
from dlrmflow.engine.training.prefetch import Done, PlanViolation, PrefetchWorker


def host_buffer(rows: int, width: int, device: torch.device) -> torch.Tensor:
    """A CPU tensor to receive fetched rows (pinned when the rows go on to a GPU)."""
    return torch.empty((rows, width), dtype=torch.float32, pin_memory=device.type == "cuda")


class RowStore:
    """The interface (and the shared counters) of the per-mode row stores."""

    spec: RowSpec
    device: torch.device

    def __init__(self, spec: RowSpec, device: torch.device) -> None:
        self.spec, self.device = spec, device
        self.bytes_fetched = 0
        self.bytes_written = 0
        self.stall_seconds = 0.0

    def gather(self, t: int, ids: np.ndarray) -> torch.Tensor:
        raise NotImplementedError

    def scatter(self, t: int, ids: np.ndarray, block: torch.Tensor) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        """After the last iteration: every row is back in its home (table or shards)."""

    def read(self, ids: np.ndarray) -> torch.Tensor:
        """Rows of ``ids`` after :meth:`finish` (evaluation), not counted as training traffic."""
        raise NotImplementedError

    def all_rows(self) -> np.ndarray:
        """Every row ``[total_rows, width]`` in global id order, after :meth:`finish`."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop background work (also on errors)."""

    # ---- the checkpoint view -------------------------------------------------------------------------

    def logical_rows(self) -> np.ndarray:
        """Every row ``[total_rows, width]`` in global id order as the home would hold it after every
        write the store still holds (a pending write-back, cached rows) has landed; a fresh array.
        Sends nothing and is not counted as traffic; waits until background work is idle."""
        raise NotImplementedError

    def traffic(self) -> dict[str, int]:
        """``bytes_fetched`` and ``bytes_written`` so far, counted as an uninterrupted run counts them
        at this point: a write that :meth:`logical_rows` includes counts as written, a row fetched
        ahead for a later iteration not yet as fetched. A run resumed from a checkpoint starts its
        counters from these."""
        return {"bytes_fetched": int(self.bytes_fetched), "bytes_written": int(self.bytes_written)}

    def cache_state(self) -> dict[str, np.ndarray] | None:
        """What a store restarted from a checkpoint needs to hold the same rows in the same cache slots
        (:meth:`restore_cache`); None for a store whose cache a checkpoint does not carry."""
        return None

    def restore_cache(self, state: dict[str, np.ndarray] | None, rows: np.ndarray) -> None:
        """After :meth:`restart_at`: cache again the rows :meth:`cache_state` recorded, their values
        taken from ``rows`` (the checkpoint's :meth:`logical_rows`, which hold every cached row's value).
        Nothing is sent or counted: an uninterrupted run fetched them before the checkpoint, and the
        checkpoint's traffic counts that. ``state`` None (a checkpoint without it): the cache stays empty."""

    def drop_pending(self) -> None:
        """Forget, without sending them, the writes the home has not applied (a pending write-back,
        cached rows) and stop background traffic: the first step of reloading a checkpoint, before
        the home is replaced. Only :meth:`restart_at` may follow."""

    def restart_at(self, t: int, rows: np.ndarray) -> None:
        """Continue at iteration ``t`` from ``rows``, every row's value before ``t`` (a checkpoint's
        :meth:`logical_rows`): afterwards :meth:`logical_rows` equals ``rows`` and gathers from ``t`` on
        return what an uninterrupted run's return. Whatever the store held is dropped unsent. A store
        backed by shards expects them to hold ``rows`` already (restored from the checkpoint)."""
        raise NotImplementedError


class LocalRows(RowStore):
    def __init__(self, spec: RowSpec, device: torch.device) -> None:
        super().__init__(spec, device)
        self.table = torch.empty((spec.total_rows, spec.width), dtype=torch.float32, device=device)
        for lo in range(0, spec.total_rows, INIT_CHUNK_ROWS):
            hi = min(lo + INIT_CHUNK_ROWS, spec.total_rows)
            self.table[lo:hi] = torch.from_numpy(init_rows(spec, np.arange(lo, hi, dtype=np.int64)))

    def _index(self, ids: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(ids).to(self.device)

    def gather(self, t: int, ids: np.ndarray) -> torch.Tensor:
        return self.table.index_select(0, self._index(ids))

    def scatter(self, t: int, ids: np.ndarray, block: torch.Tensor) -> None:
        self.table.index_copy_(0, self._index(ids), block)

    def read(self, ids: np.ndarray) -> torch.Tensor:
        return self.gather(-1, ids)

    def all_rows(self) -> np.ndarray:
        return self.table.cpu().numpy()

    def logical_rows(self) -> np.ndarray:
        return self.table.cpu().numpy().copy()

    def restart_at(self, t: int, rows: np.ndarray) -> None:
        """The table is the home: it takes ``rows``."""
        if rows.shape != tuple(self.table.shape):
            raise ValueError(f"the table holds rows of shape {tuple(self.table.shape)}, got {rows.shape}")
        self.table.copy_(torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32)))


class ShardRows(RowStore):
    """A store whose rows live on embedding shards (every mode but ``local``): the shards are the
    home, the store holds at most some newer copies."""

    def __init__(self, spec: RowSpec, device: torch.device, shards: ShardGroup) -> None:
        super().__init__(spec, device)
        self.shards = shards

    def all_rows(self) -> np.ndarray:
        return self.shards.all_rows()

    def close(self) -> None:
        self.shards.close()

    def replace_shards(self, shards: ShardGroup) -> ShardGroup:
        """Use ``shards`` from now on (after :meth:`drop_pending`: nothing is sent to the old ones);
        returns the old group, for the caller to close."""
        old, self.shards = self.shards, shards
        return old

    def restart_at(self, t: int, rows: np.ndarray) -> None:
        """The shards hold ``rows``: drop whatever the store holds."""
        self.drop_pending()


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

    def gather(self, t: int, ids: np.ndarray) -> torch.Tensor:
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

    def logical_rows(self) -> np.ndarray:
        rows = self.shards.all_rows()
        rows[self._pending_ids] = self._pending_rows
        return rows

    def traffic(self) -> dict[str, int]:
        """The pending write-back is in :meth:`logical_rows`: counted as written."""
        counts = super().traffic()
        counts["bytes_written"] += len(self._pending_ids) * self.spec.row_bytes
        return counts

    def drop_pending(self) -> None:
        self._pending_ids, self._pending_rows = self._pending_ids[:0], self._pending_rows[:0]


class SlotDirectory:
    """Which global id sits in which cache slot (both directions), as dense arrays."""

    def __init__(self, total_rows: int, num_slots: int) -> None:
        self.slot_of = np.full(total_rows, -1, dtype=np.int64)
        self.owner = np.full(num_slots, -1, dtype=np.int64)

    def place(self, ids: np.ndarray, slots: np.ndarray) -> None:
        self.slot_of[ids] = slots
        self.owner[slots] = ids

    def remove(self, ids: np.ndarray) -> np.ndarray:
        slots = self.slot_of[ids]
        self.slot_of[ids] = -1
        self.owner[slots] = -1
        return slots

    def cached_ids(self) -> np.ndarray:
        """Every cached id, sorted."""
        return np.sort(self.owner[self.owner >= 0])


class CachedRows(ShardRows):
    """Shared by the LRU and oracle stores: a cache tensor of rows plus a slot directory."""

    def __init__(self, spec: RowSpec, device: torch.device, shards: ShardGroup, num_slots: int) -> None:
        super().__init__(spec, device, shards)
        self.cache = torch.zeros((num_slots, spec.width), dtype=torch.float32, device=device)
        self.directory = SlotDirectory(spec.total_rows, num_slots)
        self._slots: torch.Tensor | None = None  # slots of the current iteration's ids

    def _slots_of(self, t: int, ids: np.ndarray) -> np.ndarray:
        slots = self.directory.slot_of[ids]
        if (slots < 0).any():
            missing = ids[slots < 0]
            raise RuntimeError(
                f"iteration {t}: {len(missing)} rows are not in the cache (first id {int(missing[0])}); "
                "the cache schedule does not match the batch stream"
            )
        return slots

    def _rows_in_slots(self, slots: np.ndarray) -> np.ndarray:
        return self.cache.index_select(0, torch.from_numpy(slots).to(self.device)).cpu().numpy()

    def _exchange_slots(
        self, write_ids: np.ndarray, write_slots: np.ndarray, fetch_ids: np.ndarray, fetch_slots: np.ndarray
    ) -> None:
        """Send the cached rows of ``write_ids`` home and fetch ``fetch_ids`` into ``fetch_slots``, in
        one synchronous round trip per shard (the shards apply the writes first)."""
        if not len(write_ids) and not len(fetch_ids):
            return
        rows = self._rows_in_slots(write_slots)
        host = host_buffer(len(fetch_ids), self.spec.width, self.device)
        self.shards.exchange(write_ids, rows, fetch_ids, out=host.numpy())
        if len(fetch_ids):
            self.cache.index_copy_(0, torch.from_numpy(fetch_slots).to(self.device), host.to(self.device))
        self.bytes_written += len(write_ids) * self.spec.row_bytes
        self.bytes_fetched += len(fetch_ids) * self.spec.row_bytes

    def _write_back_all(self) -> None:
        """Send every cached row home (the end of a run) and empty the cache."""
        ids = self.directory.cached_ids()
        self._exchange_slots(ids, self.directory.slot_of[ids], ids[:0], ids[:0])
        self.directory.remove(ids)

    def scatter(self, t: int, ids: np.ndarray, block: torch.Tensor) -> None:
        assert self._slots is not None
        self.cache.index_copy_(0, self._slots, block)

    def _empty_cache(self) -> None:
        """No row cached: a fresh directory and a zeroed cache."""
        self.directory = SlotDirectory(self.spec.total_rows, len(self.cache))
        self.cache.zero_()

    def read(self, ids: np.ndarray) -> torch.Tensor:
        host = host_buffer(len(ids), self.spec.width, self.device)
        self.shards.fetch(ids, out=host.numpy())
        return host.to(self.device)

    def logical_rows(self) -> np.ndarray:
        """The shards' rows overlaid with every cached row (a cached row is at least as new)."""
        rows = self.shards.all_rows()
        ids = self.directory.cached_ids()
        rows[ids] = self._rows_in_slots(self.directory.slot_of[ids])
        return rows


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

    def gather(self, t: int, ids: np.ndarray) -> torch.Tensor:
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
        self.cache.index_copy_(0, torch.from_numpy(slots).to(self.device),
                               torch.from_numpy(np.ascontiguousarray(rows[ids])).to(self.device))
        self.last_used[:] = last_used


class OracleRows(CachedRows):
    """Executes a lookahead plan: prefetches ``P`` iterations ahead in a background worker.

    ``start``/``rows``: begin at iteration ``start`` (a resume) with the cache the plan implies
    there, filled from ``rows`` (every row's value at ``start``: a checkpoint's image)."""

    def __init__(
        self, spec: RowSpec, device: torch.device, shards: ShardGroup, plan, iterations: int, *,
        start: int = 0, rows: np.ndarray | None = None,
    ) -> None:
        super().__init__(spec, device, shards, plan.num_slots)
        self.plan = plan
        self.iterations = iterations
        self.worker: PrefetchWorker | None = None
        self._step = None
        self.restart_at(start, rows)

    def drop_pending(self) -> None:
        """Stop the worker (before the shards it talks to go away) and empty the cache."""
        if self.worker is not None:
            self.worker.stop()
            self._collect_worker_traffic()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no copy of the old worker still lands in the cache
        self._empty_cache()

    def restart_at(self, t: int, rows: np.ndarray | None) -> None:
        """Stop any running worker, rebuild the slot directory the plan implies before iteration ``t``
        (its prefetches and evictions of ``0 .. t-1`` replayed, no data moved), load those cached rows
        from ``rows`` and start a worker at ``t`` that does not fetch them again. ``rows`` may be None
        only for ``t = 0`` (nothing is cached there)."""
        self.drop_pending()
        ids = slots = np.zeros(0, dtype=np.int64)
        if t > 0:
            if rows is None:
                raise ValueError(f"starting the oracle store at iteration {t} needs every row's value there")
            for step in self.plan.iterations():
                if step.t >= t:
                    break
                self.directory.place(np.asarray(step.prefetch_ids, dtype=np.int64),
                                     np.asarray(step.prefetch_slots, dtype=np.int64))
                self.directory.remove(np.asarray(step.evict_ids, dtype=np.int64))
            ids = self.directory.cached_ids()
            slots = self.directory.slot_of[ids]
            if len(ids):
                self.cache.index_copy_(0, torch.from_numpy(slots).to(self.device),
                                       torch.from_numpy(np.ascontiguousarray(rows[ids])).to(self.device))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the worker's side stream must not race the loads above
        self.worker = self.make_worker(t, ids, slots)
        self._step = None
        self.worker.start()

    def make_worker(self, t: int, ids: np.ndarray, slots: np.ndarray) -> PrefetchWorker:
        """The prefetch worker that starts at iteration ``t`` with ``ids`` cached in ``slots``."""
        return PrefetchWorker(
            self.plan.iterations(t), self.iterations, self.plan.config.prefetch_distance, self.cache, self.shards,
            self.spec.total_rows, start=t, cached=(ids, slots),
        )

    def _quiesce(self) -> None:
        """Wait until the worker has written back every posted eviction and has no round trip in flight."""
        self.worker.wait_idle()

    def logical_rows(self) -> np.ndarray:
        """With the worker idle (no write-back in flight, the shards' rows cannot change under the read):
        the shards' rows overlaid with every row in the cache, as the worker places them. Rows
        prefetched for iterations not yet computed equal the shards' copies; the others are newer."""
        self._quiesce()
        rows = self.shards.all_rows()
        ids = np.flatnonzero(self.worker.slot_of >= 0)
        rows[ids] = self._rows_in_slots(self.worker.slot_of[ids])
        return rows

    def traffic(self) -> dict[str, int]:
        """With the worker idle: its traffic so far, less what it fetched ahead for later iterations."""
        self._quiesce()
        counts = super().traffic()
        counts["bytes_fetched"] += int(self.worker.bytes_fetched - self.worker.bytes_fetched_ahead())
        counts["bytes_written"] += int(self.worker.bytes_written)
        return counts

    def _collect_worker_traffic(self) -> None:
        self.bytes_fetched += self.worker.bytes_fetched
        self.bytes_written += self.worker.bytes_written
        self.worker.bytes_fetched = self.worker.bytes_written = 0

    def gather(self, t: int, ids: np.ndarray) -> torch.Tensor:
        start = time.perf_counter()
        ready = self.worker.wait_ready(t)
        self.stall_seconds += time.perf_counter() - start
        self._step = ready.plan
        prefetch_ids = np.asarray(ready.plan.prefetch_ids, dtype=np.int64)
        self.directory.place(prefetch_ids, np.asarray(ready.plan.prefetch_slots, dtype=np.int64))
        slots = self._slots_of(t, ids)
        if ready.event is not None:
            torch.cuda.current_stream(self.device).wait_event(ready.event)
        self._slots = torch.from_numpy(slots).to(self.device)
        return self.cache.index_select(0, self._slots)

    def scatter(self, t: int, ids: np.ndarray, block: torch.Tensor) -> None:
        super().scatter(t, ids, block)
        evict_ids = np.asarray(self._step.evict_ids, dtype=np.int64)
        evict_slots = self.directory.slot_of[evict_ids]
        if (evict_slots < 0).any():
            raise PlanViolation(f"iteration {t}: the plan evicts id {int(evict_ids[evict_slots < 0][0])}, "
                                "which is not cached")
        self.directory.remove(evict_ids)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        self.worker.post_done(Done(t, evict_ids, evict_slots, event))

    def finish(self) -> None:
        self.worker.join()
        self._write_back_all()  # a run shorter than its plan stops with rows still cached
        self._collect_worker_traffic()  # once: finish may be called again

    def close(self) -> None:
        self.worker.stop()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        super().close()
