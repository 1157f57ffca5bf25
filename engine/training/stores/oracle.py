"""``oracle``: rows on the embedding servers, a cache driven by a lookahead plan and prefetched in the
background (:mod:`..prefetch`); with several trainers, Bagpipe's LRPP cache.

``oracle`` with W trainers (:class:`LrppRows`, Bagpipe's logically replicated, physically partitioned cache): one
plan for the global batch. A row the plan caches for one lifetime (prefetched for ``f``, evicted after
``e``) has *holders*: the trainers whose slices use it in ``f .. e`` (with parity or checkpoints, trainer 0
too), known before the run (:func:`~dlrmflow.engine.training.trainer_slices.prepare_trainers`). A trainer
holds only the rows it is a holder of, in slots of its own cache (as large as the most it holds at once).

- Fetching: each prefetched row is fetched from its server by one trainer, the one that last wrote it home
  (``id % W`` before any write; with parity trainer 0), and handed point to point to its other holders, so
  server reads do not grow with W. A trainer's write and its own later fetch of the row go to the same
  server in order, so no fetch can overtake the write it must see, whatever the other trainers' timing.
- Gradients, after the step at ``t``: a row's users send their gradients of it to its holders (a row
  with one holder is never synced); a row evicted after ``t`` only to its writer, its lowest user at
  ``t`` (with parity trainer 0), which updates it and writes it home; the other copies are dropped.
  Each recipient sums them in rank order. In classes named after Bagpipe's (whose rules differ:
  docs/trainers.md, "Bagpipe's rules beside ours"): ``sync_now``, rows used at ``t + 1`` or evicted after
  ``t``, are exchanged before ``t + 1`` starts; ``sync_later``, the others, while ``t + 1`` computes, and
  applied at its end. A read of a row whose gradient is still in flight is refused
  (:class:`~dlrmflow.engine.training.prefetch.PlanViolation`), never served stale.
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np
import torch

from dlrmflow.engine.planning.holders import LifetimeHolders, load_lifetime_holders
from dlrmflow.engine.serving.embedding_rows import RowSpec, apply_update_rowwise
from dlrmflow.engine.serving.shards import ShardGroup
from dlrmflow.engine.training.batch_split import BatchSplit
from dlrmflow.engine.training.collectives import PendingExchange, TrainerGroup, sum_over_users
from dlrmflow.engine.training.prefetch import EMPTY_IDS, Done, PartitionedPrefetchWorker, PlanViolation, PrefetchWorker
from dlrmflow.engine.training.prefetch_state import HeldStep
from dlrmflow.engine.training.run_setup import RunSetup
from dlrmflow.engine.training.stores.base import CachedRows, RowsForTrainers

EVENTS = logging.getLogger(__name__)  # a dlrmflow.engine logger: the run's log and the CLI's stderr show it
CLOSE_WAIT_S = 5.0  # how long closing the store waits for its prefetch worker to stop


def spare_slots(plan, capacity: int | None) -> int:
    """Cache rows beyond the plan's slots, for rows the worker fetches early (:mod:`..prefetch_state`): ``P - 1``
    iterations of the plan's mean prefetches and a quarter more (iterations vary, and an iteration with one row
    left to fetch costs a round trip), within ``capacity`` (``--capacity``) if given. So one round trip can
    serve ``P`` iterations also where the plan's cache is full."""
    mean = plan.counts["prefetched_rows"] / max(plan.num_iterations, 1)
    spare = math.ceil(1.25 * (plan.config.prefetch_distance - 1) * mean)
    return spare if capacity is None else max(0, min(spare, capacity - plan.num_slots))


class OracleRows(CachedRows):
    """Executes a lookahead plan: prefetches ``P`` iterations ahead in a background worker.

    ``start``/``rows``: begin at iteration ``start`` (a resume) with the cache the plan implies
    there, filled from ``rows`` (every row's value at ``start``: a checkpoint's image). The cache has the
    plan's slots and ``spare`` more (:func:`spare_slots`)."""

    def __init__(
        self, spec: RowSpec, device: torch.device, shards: ShardGroup, plan, iterations: int, *,
        start: int = 0, rows: np.ndarray | None = None, num_slots: int | None = None, spare: int = 0,
    ) -> None:
        self.spare = spare
        super().__init__(spec, device, shards, (plan.num_slots if num_slots is None else num_slots) + spare)
        self.plan = plan
        self.iterations = iterations
        self.worker: PrefetchWorker | None = None
        self._step = None
        self._worker_peak = 0  # the most rows the earlier workers' cache views held at once
        self.restart_at(start, rows)

    @property
    def peak_cached_rows(self) -> int:
        """The most rows cached at once as the worker places them: rows fetched ahead for the next ``P``
        iterations included (compute's directory is a subset of the worker's view), rows fetched early into
        spare slots not (they are at most ``spare``)."""
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
            ids, slots = self._cached_at(t)
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

    def _cached_at(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        """The rows cached before iteration ``t`` and their slots, placed in compute's directory: the plan's
        prefetches and evictions of ``0 .. t-1`` replayed (only their plan files read), no data moved."""
        for step in self.plan.iterations(0, t):
            self.directory.place(np.asarray(step.prefetch_ids, dtype=np.int64),
                                 np.asarray(step.prefetch_slots, dtype=np.int64))
            self.directory.remove(np.asarray(step.evict_ids, dtype=np.int64))
        ids = self.directory.cached_ids()
        return ids, self.directory.slot_of[ids]

    def make_worker(self, t: int, ids: np.ndarray, slots: np.ndarray) -> PrefetchWorker:
        """The prefetch worker that starts at iteration ``t`` with ``ids`` cached in ``slots``."""
        return PrefetchWorker(
            self.plan.iterations(t), self.iterations, self.plan.config.prefetch_distance, self.cache, self.shards,
            self.spec.total_rows, start=t, cached=(ids, slots), spare_slots=self.spare,
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
        self._placed(ready)
        slots = self._slots_of(t, ids)
        if ready.event is not None:
            torch.cuda.current_stream(self.device).wait_event(ready.event)
        self._slots = torch.from_numpy(slots).to(self.device)
        return self.cache.index_select(0, self._slots)

    def _placed(self, ready) -> None:
        """The worker put ``ready.ids`` in ``ready.slots``: compute's directory follows."""
        self.directory.place(np.asarray(ready.ids, dtype=np.int64), np.asarray(ready.slots, dtype=np.int64))

    def scatter(self, t: int, ids: np.ndarray, block: torch.Tensor) -> None:
        super().scatter(t, ids, block)
        evict_ids = np.asarray(self._step.evict_ids, dtype=np.int64)
        evict_slots = self.directory.slot_of[evict_ids]
        if (evict_slots < 0).any():
            raise PlanViolation(f"iteration {t}: the plan evicts id {int(evict_ids[evict_slots < 0][0])}, "
                                "which is not cached")
        self.directory.remove(evict_ids)
        self.worker.post_done(Done(t, evict_ids, evict_slots, self._compute_done()))

    def _compute_done(self) -> torch.cuda.Event | None:
        """On a GPU, an event on compute's stream after this iteration's updates of the cache: the worker
        copies evicted rows out once it has passed (None on the CPU, where compute is done already)."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def finish(self) -> None:
        self.worker.join()
        self._write_back_all()  # a run shorter than its plan stops with rows still cached
        self._collect_worker_traffic()  # once: finish may be called again

    def close(self) -> None:
        # After a run that failed, the worker may wait in a collective for a trainer that will never answer
        # (W trainers: a peer blocked in its own collective); it is left behind, a daemon thread, rather than
        # holding this trainer, and with it the run's error, until the collectives' timeout.
        if not self.worker.stop(timeout=CLOSE_WAIT_S):
            EVENTS.warning("the prefetch worker did not stop within %.0f s (%s); left behind", CLOSE_WAIT_S,
                           self.worker.state.doing or "waiting")
        elif self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        super().close()


def lowest_trainer(masks: np.ndarray) -> np.ndarray:
    """Per mask of trainers (bit w: trainer w, at least one bit set): the lowest trainer."""
    return np.log2(masks & -masks).astype(np.int64)


class LrppRows(OracleRows, RowsForTrainers):
    """Bagpipe's LRPP cache for one of W trainers (module docstring).

    ``holders``: every lifetime's holders (:class:`~dlrmflow.engine.planning.holders.LifetimeHolders`): this
    trainer's cache has ``holders.peaks[rank]`` rows. ``gateway`` (a run with parity, whose coded group has one
    client): trainer 0 fetches and writes every row (the holders then include trainer 0 in every lifetime).
    ``start``/``rows``: a resumed run, as :class:`OracleRows`."""

    def __init__(self, spec: RowSpec, device: torch.device, shards: ShardGroup | None, group: TrainerGroup, plan,
                 iterations: int, holders: LifetimeHolders, *, gateway: bool = False, start: int = 0,
                 rows: np.ndarray | None = None) -> None:
        RowsForTrainers.__init__(self, spec, device, group)
        if holders.size != group.size:
            raise ValueError(f"the holders were made for {holders.size} trainers, not {group.size}")
        self.gateway, self.holders = gateway, holders
        num_slots = holders.peaks[group.rank]
        self.slot_holders = np.zeros(num_slots, dtype=np.int64)  # per slot of this cache: its row's holders
        self.in_flight = np.zeros(spec.total_rows, dtype=bool)  # rows whose sync_later gradient is not applied
        self._later: tuple[int, np.ndarray, list, PendingExchange] | None = None
        OracleRows.__init__(self, spec, device, shards, plan, iterations, start=start, rows=rows, num_slots=num_slots)

    def _held_steps(self, t: int, stop: int | None = None):
        for step in self.plan.iterations(t, stop):
            yield HeldStep(step, self.holders.of(step.t))

    def make_worker(self, t: int, ids: np.ndarray, slots: np.ndarray) -> PrefetchWorker:
        return PartitionedPrefetchWorker(
            self._held_steps(t), self.iterations, self.plan.config.prefetch_distance, self.cache, self.shards,
            self.spec.total_rows, start=t, cached=(ids, slots), group=self.group, gateway=self.gateway)

    def _cached_at(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        """The rows this trainer holds before iteration ``t`` (the plan and the holders of ``0 .. t-1``
        replayed), in its slots ``0 ..``: the worker's pool starts from there."""
        bit = np.int64(1) << self.group.rank
        holders_of: dict[int, int] = {}
        for step in self._held_steps(0, t):
            held = (step.holders & bit) != 0
            holders_of.update(zip(np.asarray(step.prefetch_ids)[held].tolist(), step.holders[held].tolist(),
                                  strict=True))
            for x in np.asarray(step.evict_ids).tolist():
                holders_of.pop(x, None)
        ids = np.array(sorted(holders_of), dtype=np.int64)
        slots = np.arange(len(ids), dtype=np.int64)
        self.directory.place(ids, slots)
        self.slot_holders[slots] = [holders_of[x] for x in ids.tolist()]
        return ids, slots

    def _placed(self, ready) -> None:
        super()._placed(ready)
        self.slot_holders[np.asarray(ready.slots, dtype=np.int64)] = ready.holders

    def quiesce(self) -> None:
        """Before a checkpoint (every trainer calls it, then a barrier): the gradients in flight applied,
        every posted eviction home and no round trip in flight."""
        self._apply_later()
        self.worker.wait_idle()

    def gather(self, t: int, split: BatchSplit) -> torch.Tensor:
        stale = self.in_flight[split.mine]
        if stale.any():
            raise PlanViolation(f"iteration {t}: id {int(split.mine[stale][0])} is read while its gradient "
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
        t, ids, parts, pending = self._later
        start = time.perf_counter()
        received = pending.wait()
        self.sync_seconds += time.perf_counter() - start
        self._update_rows(t, ids, _with_received(parts, received), self.group.size)
        self.in_flight[ids] = False
        self._later = None

    def _send_gradients(self, split: BatchSplit, recipients: np.ndarray, rows: np.ndarray, grad: torch.Tensor,
                        kind: str, tag: int) -> tuple[np.ndarray, list, PendingExchange]:
        """Start sending each row of ``rows`` (a mask over the union) this trainer used its gradient, to the
        row's ``recipients`` (masks) but itself, and receiving the others' gradients of the rows it is a
        recipient of. Returns those rows' ids (its updates), the parts in rank order (the others' still to come
        from the exchange) and the exchange."""
        rank, users, union = split.rank, split.users, split.union
        mine = users[rank] & rows
        position = np.cumsum(users[rank]) - 1  # union index -> row of grad (this trainer's sorted ids)
        sends, counts = {}, {}
        for peer in range(split.size):
            if peer != rank:
                to_peer = mine & ((recipients >> peer) & 1 == 1)
                sends[peer] = grad[torch.from_numpy(position[to_peer])]
        here = rows & ((recipients >> rank) & 1 == 1)
        parts: list = []
        for w in range(split.size):
            part = union[here & users[w]]
            if w == rank:
                parts.append((part, grad[torch.from_numpy(position[here & users[w]])]))
            else:
                parts.append((part, None))
                counts[w] = len(part)
        pending = self.group.exchange_rows(sends, counts, grad.shape[1], kind, tag=tag)
        return union[here], parts, pending

    def update(self, t: int, split: BatchSplit, next_union: np.ndarray, block: torch.Tensor,
               grad: torch.Tensor) -> None:
        union = split.union
        evict = np.asarray(self._step.evict_ids, dtype=np.int64)
        evicted = np.isin(union, evict, assume_unique=True)
        if np.count_nonzero(evicted) != len(evict):
            raise PlanViolation(f"iteration {t}: the plan evicts a row the batch does not use")
        # An evicted row's writer is its lowest user at t (with parity, trainer 0: the only one writing home);
        # its gradient goes to the writer only. Any other row's goes to its holders. A row this trainer
        # neither holds nor writes is none of its business (its bits here stay 0).
        writer = np.zeros(len(union), dtype=np.int64) if self.gateway else split.first_user()
        slot = self.directory.slot_of[union]
        held = slot >= 0
        recipients = np.zeros(len(union), dtype=np.int64)
        recipients[held] = self.slot_holders[slot[held]]
        recipients[evicted] = np.int64(1) << writer[evicted]
        now = evicted | np.isin(union, next_union, assume_unique=True)

        grad = grad.cpu()  # the exchanges and the rank-order sums are on the host (collectives.py)
        start = time.perf_counter()
        ids, parts, pending = self._send_gradients(split, recipients, now, grad, "sync_now", tag=1)
        parts = _with_received(parts, pending.wait())
        self.sync_seconds += time.perf_counter() - start
        self._update_rows(t, ids, parts, split.size)
        self._apply_later()  # the previous iteration's: none of its rows is used at t or t + 1
        ids, parts, pending = self._send_gradients(split, recipients, ~now, grad, "sync_later", tag=2)
        self._later = (t, ids, parts, pending)
        self.in_flight[ids] = True

        gone = evict[held[evicted]]  # the evicted rows this trainer holds
        gone_slots = self.directory.slot_of[gone]
        self.directory.remove(gone)
        self.worker.post_done(Done(t, gone, gone_slots, self._compute_done(), writer[evicted], evict))

    def _write_back_all(self) -> None:
        """Every cached row home, each by its lowest holder (its holders' copies are all current)."""
        ids = self.directory.cached_ids()
        slots = self.directory.slot_of[ids]
        share = lowest_trainer(self.slot_holders[slots]) == self.group.rank
        self._exchange_slots(ids[share], slots[share], EMPTY_IDS, EMPTY_IDS)
        self.directory.remove(ids)

    def finish(self) -> None:
        self._apply_later()
        OracleRows.finish(self)


def _with_received(parts: list, received: dict[int, torch.Tensor]) -> list[tuple[np.ndarray, torch.Tensor]]:
    """``parts`` (ids, rows or None; this trainer's own rows are never None) with each other trainer's rows
    taken from ``received`` (absent: it sent none)."""
    width = next(rows.shape[1] for _, rows in parts if rows is not None)
    return [(ids, rows if rows is not None else received.get(w, torch.zeros((0, width))))
            for w, (ids, rows) in enumerate(parts)]


def make_store(setup: RunSetup, device: torch.device, shards: ShardGroup, group: TrainerGroup, *, start: int = 0,
               rows: np.ndarray | None = None) -> OracleRows | LrppRows:
    if group.size == 1:
        return OracleRows(setup.spec, device, shards, setup.plan, setup.iterations, start=start, rows=rows,
                          spare=spare_slots(setup.plan, setup.config.capacity))
    holders = load_lifetime_holders(setup.trainers_dir)
    return LrppRows(setup.spec, device, shards, group, setup.plan, setup.iterations, holders,
                    gateway=bool(setup.config.parity), start=start, rows=rows)
