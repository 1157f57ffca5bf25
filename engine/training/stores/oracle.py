"""``oracle``: rows on the embedding servers, a cache driven by a lookahead plan and prefetched in the
background (:mod:`..prefetch`); with several trainers, Bagpipe's LRPP cache.

``oracle`` with W trainers (:class:`LrppRows`, Bagpipe's logically replicated, physically partitioned cache): one
plan for the global batch. A row the plan caches for one lifetime (prefetched for ``f``, evicted after
``e``) has *holders*: the trainers whose slices use it in ``f .. e`` (with parity or checkpoints, trainer 0
too), known before the run (:func:`~dlrmflow.engine.training.trainer_slices.prepare_trainers`). A trainer
holds only the rows it is a holder of, in slots of its own cache (as large as the most it holds at once).

- Fetching: each prefetched row is fetched from its server by one trainer, the one that last wrote it home
  while that write may be on its way (else ``id % W``; with parity trainer 0:
  :class:`~dlrmflow.engine.training.prefetch_state.PartitionedPrefetchState`), and handed point to point to
  its other holders, so server reads do not grow with W. A trainer's write and its own later fetch of the
  row go to the same server in order, so no fetch can overtake the write it must see, whatever the other
  trainers' timing.
- Gradients, after backward at ``t``: a row's users send their gradients of it to its holders (a row
  with one holder is never synced); a row evicted after ``t`` only to its writer, its lowest user at
  ``t`` (with parity trainer 0), which updates it and writes it home; the other copies are dropped.
  Each recipient sums them in rank order. In classes named after Bagpipe's (whose rules differ:
  docs/trainers.md, "Bagpipe's rules beside ours"): ``sync_now``, rows used at ``t + 1`` or evicted after
  ``t``, are sent before ``t + 1`` starts; ``sync_later``, the others, while ``t + 1`` computes, and
  applied at its end. A read of a row whose gradient is still in flight is refused
  (:class:`~dlrmflow.engine.training.prefetch.PlanViolation`), never served stale.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch

from dlrmflow.engine.planning.holders import LifetimeHolders, load_lifetime_holders
from dlrmflow.engine.serving.embedding_rows import RowSpec
from dlrmflow.engine.serving.shards import ShardGroup
from dlrmflow.engine.training.batch_split import BatchSplit
from dlrmflow.engine.training.collectives import PendingSends, TrainerGroup, sum_over_users
from dlrmflow.engine.training.prefetch import EMPTY_IDS, Done, PartitionedPrefetchWorker, PlanViolation, PrefetchWorker
from dlrmflow.engine.training.prefetch_state import HeldStep
from dlrmflow.engine.training.row_updates import apply_update, apply_update_rowwise
from dlrmflow.engine.training.run_setup import RunSetup
from dlrmflow.engine.training.slot_directory import SlotDirectory
from dlrmflow.engine.training.stores.base import IterationRows, RowStore, rule_at
from dlrmflow.engine.training.stores.homes import ShardHome
from dlrmflow.engine.training.stores.slot_cache import SlotCache

EVENTS = logging.getLogger(__name__)  # a dlrmflow.engine logger: the run's log and the CLI's stderr show it
CLOSE_WAIT_S = 5.0  # how long closing the store waits for its prefetch worker to stop

# (t, ids, slots) -> the prefetch worker that starts at iteration t with ids cached in slots
WorkerFactory = Callable[[int, np.ndarray, np.ndarray], PrefetchWorker]
# (t, directory) -> the rows cached before iteration t and their slots, placed in compute's directory
CachedAt = Callable[[int, SlotDirectory], tuple[np.ndarray, np.ndarray]]


def spare_slots(plan, capacity: int | None) -> int:
    """Cache rows beyond the plan's slots, for rows the worker fetches early (:mod:`..prefetch_state`): ``P - 1``
    iterations of the plan's mean prefetches and a quarter more (iterations vary, and an iteration with one row
    left to fetch costs a round trip), within ``capacity`` (``--capacity``) if given. So one round trip can
    serve ``P`` iterations also where the plan's cache is full."""
    mean = plan.counts["prefetched_rows"] / max(plan.num_iterations, 1)
    spare = math.ceil(1.25 * (plan.config.prefetch_distance - 1) * mean)
    return spare if capacity is None else max(0, min(spare, capacity - plan.num_slots))


def replay_plan(plan, t: int, directory: SlotDirectory) -> tuple[np.ndarray, np.ndarray]:
    """The rows one trainer caches before iteration ``t`` and their slots, placed in ``directory``: the plan's
    prefetches and evictions of ``0 .. t-1`` replayed (only their plan files read), no data moved."""
    for step in plan.iterations(0, t):
        directory.place(np.asarray(step.prefetch_ids, dtype=np.int64), np.asarray(step.prefetch_slots, dtype=np.int64))
        directory.remove(np.asarray(step.evict_ids, dtype=np.int64))
    return directory.cached()


class PlanCache:
    """A :class:`~.slot_cache.SlotCache` whose rows a prefetch worker places ahead of compute, by a plan: owns
    the cache and the worker's lifecycle (start at an iteration, stop, restart from a checkpoint's rows).

    Compute's directory (the cache's) follows the worker's view as each iteration's rows are handed over
    (:meth:`take`); the store talks to the worker through its methods, never to its state."""

    def __init__(self, cache: SlotCache, make_worker: WorkerFactory, cached_at: CachedAt) -> None:
        self.cache, self.make_worker, self.cached_at = cache, make_worker, cached_at
        self.worker: PrefetchWorker | None = None
        self._worker_peak = 0  # the most rows the earlier workers' views held at once

    @property
    def peak(self) -> int:
        """The most rows cached at once as the worker places them: rows fetched ahead for the next ``P``
        iterations included (compute's directory is a subset of the worker's view), rows fetched early into
        spare slots not (they are at most the spare slots)."""
        return max(self._worker_peak, 0 if self.worker is None else self.worker.peak_held)

    def stop(self) -> None:
        """Stop the worker (before the shards it talks to go away) and empty the cache."""
        if self.worker is not None:
            self.worker.stop()
            self._worker_peak = max(self._worker_peak, self.worker.peak_held)
        self._synchronize()  # no copy of the old worker still lands in the cache
        self.cache.empty()

    def _synchronize(self) -> None:
        if self.cache.device.type == "cuda":
            torch.cuda.synchronize(self.cache.device)

    def restart(self, t: int, rows: np.ndarray | None) -> None:
        """Stop any running worker, rebuild the cache the plan implies before iteration ``t`` (``cached_at``),
        load those rows from ``rows`` and start a worker at ``t`` that does not fetch them again. ``rows`` may
        be None only for ``t = 0`` (nothing is cached there)."""
        self.stop()
        ids = slots = np.zeros(0, dtype=np.int64)
        if t > 0:
            if rows is None:
                raise ValueError(f"starting the oracle store at iteration {t} needs every row's value there")
            ids, slots = self.cached_at(t, self.cache.directory)
            if len(ids):
                held = np.ascontiguousarray(rows[ids])
                self.cache.load(slots, held)
                self.cache.home.held_by_trainer(ids, held)  # with parity: the old rows of their first write-backs
        self._synchronize()  # the worker's side stream must not race the loads above
        self.worker = self.make_worker(t, ids, slots)
        self.worker.start()

    def take(self, t: int, ids: np.ndarray):
        """Wait for iteration ``t``'s rows; returns the worker's :class:`~..prefetch.Ready` and the slots of
        ``ids`` (compute's directory now has the rows the worker placed for ``t``)."""
        ready = self.worker.wait_ready(t)
        self.cache.directory.place(np.asarray(ready.ids, dtype=np.int64), np.asarray(ready.slots, dtype=np.int64))
        slots = self.cache.slots_of(t, ids)
        if ready.event is not None:
            torch.cuda.current_stream(self.cache.device).wait_event(ready.event)
        return ready, self.cache.index(slots)

    def post_evictions(self, done: Done) -> None:
        self.worker.post_done(done)

    def held(self) -> tuple[np.ndarray, np.ndarray]:
        """With the worker idle (no write-back in flight, the shards' rows cannot change while they are
        read): every row in the cache, as the worker places them. Rows prefetched for iterations not yet
        computed equal the shards' copies; the others are newer."""
        self.worker.wait_idle()
        ids, slots = self.worker.cached()
        return ids, self.cache.in_slots(slots)

    def traffic(self) -> dict[str, int]:
        """With the worker idle: what the home moved, less what the worker fetched ahead for iterations compute
        has not reached (an uninterrupted run counts those later)."""
        self.worker.wait_idle()
        home = self.cache.home
        return {"bytes_fetched": int(home.bytes_fetched - self.worker.bytes_fetched_ahead()),
                "bytes_written": int(home.bytes_written)}

    def join(self) -> None:
        """Wait until the worker has written back every posted eviction."""
        self.worker.join()
        self._worker_peak = max(self._worker_peak, self.worker.peak_held)

    def close(self) -> None:
        # After a run that failed, the worker may wait in a collective for a trainer that will never answer
        # (W trainers: a peer blocked in its own collective); it is left behind, a daemon thread, rather than
        # holding this trainer, and with it the run's error, until the collectives' timeout.
        if not self.worker.stop(timeout=CLOSE_WAIT_S):
            EVENTS.warning("the prefetch worker did not stop within %.0f s (%s); left behind", CLOSE_WAIT_S,
                           self.worker.doing or "waiting")
        else:
            self._synchronize()


def compute_done(device: torch.device) -> torch.cuda.Event | None:
    """On a GPU, an event on compute's stream after this iteration's updates of the cache: the worker
    copies evicted rows out once it has passed (None on the CPU, where compute is done already)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


class OracleRows(RowStore):
    """Executes a lookahead plan: prefetches ``P`` iterations ahead in a background worker.

    ``start``/``rows``: begin at iteration ``start`` (a resume) with the cache the plan implies
    there, filled from ``rows`` (every row's value at ``start``: a checkpoint's image). The cache has the
    plan's slots and ``spare`` more (:func:`spare_slots`)."""

    def __init__(
        self, spec: RowSpec, device: torch.device, shards: ShardGroup, plan, iterations: int, *,
        start: int = 0, rows: np.ndarray | None = None, spare: int = 0,
    ) -> None:
        self.spec, self.device, self.plan, self.iterations, self.spare = spec, device, plan, iterations, spare
        self.home = ShardHome(spec, shards)
        self.stall_seconds = 0.0
        self.cache = SlotCache(spec, device, self.home, plan.num_slots + spare)
        self.plan_cache = PlanCache(self.cache, self._make_worker, lambda t, d: replay_plan(plan, t, d))
        self.plan_cache.restart(start, rows)

    def _make_worker(self, t: int, ids: np.ndarray, slots: np.ndarray) -> PrefetchWorker:
        return PrefetchWorker(
            self.plan.iterations(t), self.iterations, self.plan.config.prefetch_distance, self.cache.rows, self.home,
            start=t, cached=(ids, slots), spare_slots=self.spare,
        )

    @property
    def peak_cached_rows(self) -> int:
        return self.plan_cache.peak

    def gather(self, t: int, split: BatchSplit, next_union: np.ndarray) -> IterationRows:
        start = time.perf_counter()
        ready, slots = self.plan_cache.take(t, split.mine)
        self.stall_seconds += time.perf_counter() - start
        return IterationRows(t, split, next_union, self.cache.rows.index_select(0, slots), slots=slots,
                             plan=ready.plan)

    def update(self, gathered: IterationRows, grad: torch.Tensor, lr: float) -> None:
        apply_update(rule_at(self.spec, lr), gathered.rows, grad)
        self.cache.rows.index_copy_(0, gathered.slots, gathered.rows)
        evict_ids = np.asarray(gathered.plan.evict_ids, dtype=np.int64)
        evict_slots = self.cache.directory.lookup(evict_ids)
        if (evict_slots < 0).any():
            raise PlanViolation(f"iteration {gathered.t}: the plan evicts id {int(evict_ids[evict_slots < 0][0])}, "
                                "which is not cached")
        self.cache.directory.remove(evict_ids)
        self.plan_cache.post_evictions(Done(gathered.t, evict_ids, evict_slots, compute_done(self.device)))

    def finish(self) -> None:
        self.plan_cache.join()
        self.cache.write_back(self.cache.directory.cached_ids())  # a run shorter than its plan stops with rows cached

    def held_rows(self) -> tuple[np.ndarray, np.ndarray]:
        return self.plan_cache.held()

    def traffic(self) -> dict[str, int]:
        return self.plan_cache.traffic()

    def drop_pending(self) -> None:
        self.plan_cache.stop()

    def restart_at(self, t: int, rows: np.ndarray | None) -> None:
        self.plan_cache.restart(t, rows)

    def close(self) -> None:
        self.plan_cache.close()
        self.home.close()


def lowest_trainer(masks: np.ndarray) -> np.ndarray:
    """Per mask of trainers (bit w: trainer w, at least one bit set): the lowest trainer."""
    return np.log2(masks & -masks).astype(np.int64)


class LrppRows(RowStore):
    """Bagpipe's LRPP cache for one of W trainers (module docstring).

    ``holders``: every lifetime's holders (:class:`~dlrmflow.engine.planning.holders.LifetimeHolders`): this
    trainer's cache has ``holders.peaks[rank]`` rows. ``gateway`` (a run with parity, whose coded group has one
    client): trainer 0 fetches and writes every row (the holders then include trainer 0 in every lifetime).
    ``start``/``rows``: a resumed run, as :class:`OracleRows`. This trainer's counters count from the resume
    (the checkpoint holds trainer 0's)."""

    def __init__(self, spec: RowSpec, device: torch.device, shards: ShardGroup | None, group: TrainerGroup, plan,
                 iterations: int, holders: LifetimeHolders, *, gateway: bool = False, start: int = 0,
                 rows: np.ndarray | None = None) -> None:
        if holders.size != group.size:
            raise ValueError(f"the holders were made for {holders.size} trainers, not {group.size}")
        self.spec, self.device, self.group, self.plan, self.iterations = spec, device, group, plan, iterations
        self.gateway, self.holders = gateway, holders
        self.home = ShardHome(spec, shards)
        self.stall_seconds = self.sync_seconds = 0.0
        num_slots = holders.peaks[group.rank]
        self.cache = SlotCache(spec, device, self.home, num_slots)
        self.slot_holders = np.zeros(num_slots, dtype=np.int64)  # per slot of this cache: its row's holders
        self._later: tuple[int, np.ndarray, list, PendingSends] | None = None
        self.plan_cache = PlanCache(self.cache, self._make_worker, self._cached_at)
        self.plan_cache.restart(start, rows)

    def _held_steps(self, t: int, stop: int | None = None) -> Iterator[HeldStep]:
        for step in self.plan.iterations(t, stop):
            yield HeldStep(step, self.holders.of(step.t))

    def _make_worker(self, t: int, ids: np.ndarray, slots: np.ndarray) -> PrefetchWorker:
        return PartitionedPrefetchWorker(
            self._held_steps(t), self.iterations, self.plan.config.prefetch_distance, self.cache.rows, self.home,
            start=t, cached=(ids, slots), group=self.group, gateway=self.gateway)

    def _cached_at(self, t: int, directory: SlotDirectory) -> tuple[np.ndarray, np.ndarray]:
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
        directory.place(ids, slots)
        self.slot_holders[slots] = [holders_of[x] for x in ids.tolist()]
        return ids, slots

    @property
    def peak_cached_rows(self) -> int:
        return self.plan_cache.peak

    def quiesce(self) -> None:
        """Before a checkpoint (every trainer calls it, then a barrier): the gradients in flight applied,
        every posted eviction home and no round trip in flight."""
        self._apply_later()
        self.plan_cache.worker.wait_idle()

    def gather(self, t: int, split: BatchSplit, next_union: np.ndarray) -> IterationRows:
        # The rows whose sync_later gradient is still in flight (those of the previous iteration's _later).
        stale = np.zeros(len(split.mine), dtype=bool) if self._later is None else np.isin(split.mine, self._later[1])
        if stale.any():
            raise PlanViolation(f"iteration {t}: id {int(split.mine[stale][0])} is read while its gradient "
                                "from an earlier iteration is still being synced (a stale read)")
        start = time.perf_counter()
        ready, slots = self.plan_cache.take(t, split.mine)
        self.stall_seconds += time.perf_counter() - start
        self.slot_holders[np.asarray(ready.slots, dtype=np.int64)] = ready.holders
        return IterationRows(t, split, next_union, self.cache.rows.index_select(0, slots), slots=slots,
                             plan=ready.plan)

    def _update_rows(self, lr: float, ids: np.ndarray, parts: list[tuple[np.ndarray, torch.Tensor]],
                     size: int) -> None:
        """Apply gradients at the row learning rate ``lr`` (the iteration's they came from, also when applied
        later)."""
        if not len(ids):
            return
        slots = self.cache.index(self.cache.directory.lookup(ids))
        rows = self.cache.rows.index_select(0, slots)
        apply_update_rowwise(rule_at(self.spec, lr), rows, sum_over_users(ids, parts, size))
        self.cache.rows.index_copy_(0, slots, rows)

    def _apply_later(self) -> None:
        """Wait for the sync_later gradients in flight and update those rows."""
        if self._later is None:
            return
        lr, ids, parts, pending = self._later
        start = time.perf_counter()
        received = pending.wait()
        self.sync_seconds += time.perf_counter() - start
        self._update_rows(lr, ids, _with_received(parts, received), self.group.size)
        self._later = None

    def _send_gradients(self, split: BatchSplit, recipients: np.ndarray, rows: np.ndarray, grad: torch.Tensor,
                        kind: str, tag: int) -> tuple[np.ndarray, list, PendingSends]:
        """Start sending each row of ``rows`` (a mask over the union) this trainer used its gradient, to the
        row's ``recipients`` (masks) but itself, and receiving the others' gradients of the rows it is a
        recipient of. Returns those rows' ids (its updates), the parts in rank order (the others' still to come
        from the sends) and the sends in flight."""
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
        pending = self.group.send_rows(sends, counts, grad.shape[1], kind, tag=tag)
        return union[here], parts, pending

    def update(self, gathered: IterationRows, grad: torch.Tensor, lr: float) -> None:
        t, split = gathered.t, gathered.split
        union = split.union
        evict = np.asarray(gathered.plan.evict_ids, dtype=np.int64)
        evicted = np.isin(union, evict, assume_unique=True)
        if np.count_nonzero(evicted) != len(evict):
            raise PlanViolation(f"iteration {t}: the plan evicts a row the batch does not use")
        # An evicted row's writer is its lowest user at t (with parity, trainer 0: the only one writing home);
        # its gradient goes to the writer only. Any other row's goes to its holders. A row this trainer
        # neither holds nor writes is none of its business (its bits here stay 0).
        directory = self.cache.directory
        writer = np.zeros(len(union), dtype=np.int64) if self.gateway else split.first_user()
        slot = directory.lookup(union)
        held = slot >= 0
        recipients = np.zeros(len(union), dtype=np.int64)
        recipients[held] = self.slot_holders[slot[held]]
        recipients[evicted] = np.int64(1) << writer[evicted]
        now = evicted | np.isin(union, gathered.next_union, assume_unique=True)

        grad = grad.cpu()  # the sends and the rank-order sums are on the host (collectives.py)
        start = time.perf_counter()
        ids, parts, pending = self._send_gradients(split, recipients, now, grad, "sync_now", tag=1)
        parts = _with_received(parts, pending.wait())
        self.sync_seconds += time.perf_counter() - start
        self._update_rows(lr, ids, parts, split.size)
        self._apply_later()  # the previous iteration's: none of its rows is used at t or t + 1
        ids, parts, pending = self._send_gradients(split, recipients, ~now, grad, "sync_later", tag=2)
        self._later = (lr, ids, parts, pending)

        gone = evict[held[evicted]]  # the evicted rows this trainer holds
        gone_slots = directory.lookup(gone)
        directory.remove(gone)
        self.plan_cache.post_evictions(Done(t, gone, gone_slots, compute_done(self.device), writer[evicted], evict))

    def finish(self) -> None:
        """Every cached row home, each by its lowest holder (its holders' copies are all current)."""
        self._apply_later()
        self.plan_cache.join()
        directory = self.cache.directory
        ids = directory.cached_ids()
        slots = directory.lookup(ids)
        share = lowest_trainer(self.slot_holders[slots]) == self.group.rank
        self.cache.exchange(ids[share], slots[share], EMPTY_IDS, EMPTY_IDS)
        directory.remove(ids)

    def held_rows(self) -> tuple[np.ndarray, np.ndarray]:
        return self.plan_cache.held()

    def traffic(self) -> dict[str, int]:
        return self.plan_cache.traffic()

    def resume_from(self, traffic: dict[str, int], cache: dict[str, np.ndarray] | None, rows: np.ndarray) -> None:
        """Nothing: this trainer counts from the resume, and its cache was rebuilt from the plan at the start."""

    def drop_pending(self) -> None:
        self.plan_cache.stop()

    def restart_at(self, t: int, rows: np.ndarray | None) -> None:
        self.plan_cache.restart(t, rows)

    def close(self) -> None:
        self.plan_cache.close()
        self.home.close()


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
