"""``oracle``: rows on the embedding servers, a cache driven by a lookahead plan and prefetched in the
background (:mod:`..prefetch`); with several trainers, Bagpipe's LRPP cache.

``oracle`` with W trainers (:class:`LrppRows`, Bagpipe's logically replicated, physically partitioned cache): one
plan for the global batch, and every trainer holds the same cache slots. Each prefetched row is
fetched from its server by one trainer and handed to the others over the trainer group (so server
reads do not grow with W); each evicted row is written home by one trainer. After the step a row
used at ``t`` is, in classes named after Bagpipe's (whose rules differ: docs/trainers.md, "Bagpipe's rules
beside ours"):

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

import numpy as np
import torch

from dlrmflow.engine.serving.embedding_rows import RowSpec, apply_update_rowwise
from dlrmflow.engine.serving.shards import ShardGroup
from dlrmflow.engine.training.batch_split import BatchSplit
from dlrmflow.engine.training.collectives import PendingGather, TrainerGroup, sum_over_users
from dlrmflow.engine.training.prefetch import EMPTY_IDS, Done, PartitionedPrefetchWorker, PlanViolation, PrefetchWorker
from dlrmflow.engine.training.setup import RunSetup
from dlrmflow.engine.training.stores.base import CachedRows, RowsForTrainers


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
        self._worker_peak = 0  # the most rows the earlier workers' cache views held at once
        self.restart_at(start, rows)

    @property
    def peak_cached_rows(self) -> int:
        """The most rows cached at once as the worker places them: rows fetched ahead for the next ``P``
        iterations included (compute's directory is a subset of the worker's view)."""
        return max(self._worker_peak, 0 if self.worker is None else self.worker.state.peak_held)

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
            for step in self.plan.iterations(0, t):  # only the plan files of iterations 0 .. t-1
                self.directory.place(np.asarray(step.prefetch_ids, dtype=np.int64),
                                     np.asarray(step.prefetch_slots, dtype=np.int64))
                self.directory.remove(np.asarray(step.evict_ids, dtype=np.int64))
            ids = self.directory.cached_ids()
            slots = self.directory.slot_of[ids]
            if len(ids):
                held = np.ascontiguousarray(rows[ids])
                self.cache.index_copy_(0, torch.from_numpy(slots).to(self.device),
                                       torch.from_numpy(held).to(self.device))
                self.shards.held_by_trainer(ids, held)  # with parity: the old rows of their first write-backs
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

    def held_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """With the worker idle (no write-back in flight, the shards' rows cannot change while they are
        read): every row in the cache, as the worker places them. Rows prefetched for iterations not yet
        computed equal the shards' copies; the others are newer."""
        self._quiesce()
        ids = np.flatnonzero(self.worker.slot_of >= 0)
        return ids, self._rows_in_slots(self.worker.slot_of[ids])

    def traffic(self) -> dict[str, int]:
        """With the worker idle: its traffic so far, less what it fetched ahead for later iterations."""
        self._quiesce()
        counts = super().traffic()
        counts["bytes_fetched"] += int(self.worker.bytes_fetched - self.worker.bytes_fetched_ahead())
        counts["bytes_written"] += int(self.worker.bytes_written)
        return counts

    def _collect_worker_traffic(self) -> None:
        self._worker_peak = max(self._worker_peak, self.worker.state.peak_held)
        self.bytes_fetched += self.worker.bytes_fetched
        self.bytes_written += self.worker.bytes_written
        self.worker.bytes_fetched = self.worker.bytes_written = 0

    def gather_ids(self, t: int, ids: np.ndarray) -> torch.Tensor:
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


def sync_classes(split: BatchSplit, next_union: np.ndarray, evict: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The classes (Bagpipe's names, our rules) of the rows iteration ``t`` used, as masks over
    ``split.union``: ``(no_sync, sync_now, sync_later)`` for the plan's evictions after ``t`` (``evict``,
    sorted) and the next iteration's ids (``next_union``, sorted). See the module docstring."""
    evicted = np.isin(split.union, evict, assume_unique=True)
    if np.count_nonzero(evicted) != len(evict):
        raise PlanViolation(f"iteration {split.t}: the plan evicts a row the batch does not use")
    no_sync = (split.users.sum(axis=0) == 1) & evicted
    now = ~no_sync & (evicted | np.isin(split.union, next_union, assume_unique=True))
    return no_sync, now, ~no_sync & ~now


class LrppRows(OracleRows, RowsForTrainers):
    """Bagpipe's LRPP cache for one of W trainers (module docstring).

    ``gateway`` (a run with parity, whose coded group has one client): trainer 0 fetches and writes
    every row, so no row is ``no_sync`` (trainer 0's copy of every row must be current).
    ``start``/``rows``: a resumed run, as :class:`OracleRows`."""

    def __init__(self, spec: RowSpec, device: torch.device, shards: ShardGroup | None, group: TrainerGroup, plan,
                 iterations: int, *, gateway: bool = False, start: int = 0, rows: np.ndarray | None = None) -> None:
        RowsForTrainers.__init__(self, spec, device, group)
        self.gateway = gateway
        self.in_flight = np.zeros(spec.total_rows, dtype=bool)  # rows whose sync_later gradient is not applied
        self._later: tuple[int, np.ndarray, list[np.ndarray], PendingGather] | None = None
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
        return OracleRows.gather_ids(self, t, split.mine)

    def _update_rows(self, t: int, ids: np.ndarray, parts: list[tuple[np.ndarray, torch.Tensor]], size: int) -> None:
        """Apply iteration ``t``'s gradients (``t``: the learning rate's iteration, also when applied later)."""
        if not len(ids):
            return
        slots = torch.from_numpy(self.directory.slot_of[ids]).to(self.device)
        rows = self.cache.index_select(0, slots)
        apply_update_rowwise(self.spec_at(t), rows, sum_over_users(ids, parts, size))
        self.cache.index_copy_(0, slots, rows)

    def _apply_later(self) -> None:
        """Wait for the sync_later gradients in flight and update those rows."""
        if self._later is None:
            return
        t, ids, held, pending = self._later
        start = time.perf_counter()
        parts = pending.wait()
        self.sync_seconds += time.perf_counter() - start
        self._update_rows(t, ids, list(zip(held, parts, strict=True)), self.group.size)
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
        self._update_rows(t, union[now], list(zip(ids, parts, strict=True)), size)
        own = no_sync & split.users[split.rank]
        own_grad = grad[torch.from_numpy(np.flatnonzero(own[split.where[split.rank]]))]
        self._update_rows(t, union[own], [(union[own], own_grad)], size)
        self._apply_later()  # the previous iteration's: none of its rows is used at t or t + 1
        ids, pending = self._gather_gradients(split, later, grad, "sync_later", async_op=True)
        self._later = (t, union[later], ids, pending)
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


def make_store(setup: RunSetup, device: torch.device, shards: ShardGroup, group: TrainerGroup, *, start: int = 0,
               rows: np.ndarray | None = None) -> OracleRows | LrppRows:
    if group.size == 1:
        return OracleRows(setup.spec, device, shards, setup.plan, setup.iterations, start=start, rows=rows)
    return LrppRows(setup.spec, device, shards, group, setup.plan, setup.iterations, gateway=bool(setup.config.parity),
                    start=start, rows=rows)
