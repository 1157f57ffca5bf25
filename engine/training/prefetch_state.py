"""The oracle prefetch worker's state, and the only code that changes it.

:class:`PrefetchState` holds the plan cursor (the next iteration to prepare, ``t``; the iterations
whose evictions are taken, ``written``), the worker's view of the cache (``slot_of`` / ``owner``: a
row occupies its slot from its prefetch until its eviction is taken, and its copy then goes home in
the next exchange, which the shards apply before that exchange's fetches), the evictions compute
posted and the worker has not taken yet, and the taken ones not yet sent. Events come in as named
transitions (:meth:`~PrefetchState.plan_read`, :meth:`~PrefetchState.evictions_posted`,
:meth:`~PrefetchState.evictions_taken`, :meth:`~PrefetchState.exchanged`); what the worker must do
next comes out of :meth:`~PrefetchState.step` as an action (:class:`ReadPlan`, :class:`WaitForDone`,
:class:`Exchange`, :class:`Finished`), and :meth:`~PrefetchState.evictions_taken` answers with the rows
to copy out of the cache (:class:`CopyOut`). No threads, no streams, no network: the driver
(:class:`~dlrmflow.engine.training.prefetch.PrefetchWorker`) holds its lock around every call, moves
the data and reports what it did. Attributes are read-only outside this class.

The rules, for prefetch distance ``P`` (docs/planner.md argues them):

- the exchange for iteration ``t`` is issued once the evictions of ``0 .. t-P-1`` are taken
  (``written >= t - P``; in steady state it waits for those of ``t-P-1``), and it writes them home
  before it fetches. So a row evicted after ``u`` is home before any fetch issued for
  ``t >= u + P + 1``: no stale read;
- a plan step that would overwrite a row not yet taken, fetch a row whose newer copy is still cached
  or not yet sent, or evict rows not where the worker put them raises :class:`PlanViolation`.

:class:`PartitionedPrefetchState` adds the rules of one of W trainers holding the same slots (the
LRPP cache): which trainer fetches each row (the one that last wrote it home, else ``id % W``;
``gateway``: trainer 0) and which evicted rows this trainer writes home (those ``Done.writers`` gives it).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

EMPTY_IDS = np.zeros(0, dtype=np.int64)


class PlanViolation(RuntimeError):
    """A plan step would read a stale row or overwrite a live one."""


@dataclass
class Done:
    """Compute finished iteration ``t``: the rows the plan evicts after it, and the slots compute had them in."""

    t: int
    evict_ids: np.ndarray
    evict_slots: np.ndarray
    event: Any  # GPU: a torch.cuda.Event recorded after the iteration's update of the cache (None on CPU)
    # Several trainers: every row the plan evicts after t (``evict_ids`` are those this trainer holds; None:
    # the same) and the trainer that writes each of them home.
    writers: np.ndarray | None = None
    evicted: np.ndarray | None = None


class HeldStep:
    """A plan step with its prefetches' holders (what a :class:`PartitionedPrefetchState` reads)."""

    __slots__ = ("t", "prefetch_ids", "prefetch_slots", "evict_ids", "holders")

    def __init__(self, step, holders: np.ndarray) -> None:
        self.t, self.prefetch_ids, self.prefetch_slots = step.t, step.prefetch_ids, step.prefetch_slots
        self.evict_ids, self.holders = step.evict_ids, holders


# ---- actions ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReadPlan:
    """Action: take the plan's next step (iteration ``t``); report it with :meth:`PrefetchState.plan_read`."""

    t: int


@dataclass(frozen=True)
class WaitForDone:
    """Action: the next step needs the evictions of iteration ``t``. Once compute has posted some
    (:meth:`PrefetchState.has_posted`), call :meth:`PrefetchState.evictions_taken`."""

    t: int


@dataclass(frozen=True, eq=False)
class CopyOut:
    """Answer to :meth:`PrefetchState.evictions_taken`: copy the rows in ``slots`` out of the cache now
    (after ``done.event``, compute's last update of them); they go home, as ``ids``, in the next
    :class:`Exchange`. The slots are free from now on in the worker's view."""

    done: Done
    ids: np.ndarray
    slots: np.ndarray


@dataclass(frozen=True, eq=False)
class Exchange:
    """Action: one round trip per shard that writes ``write_ids`` home (the rows copied out for them, in
    the order of the :class:`CopyOut` answers since the last exchange) and then fetches ``fetch_ids``
    into ``fetch_slots``; report :meth:`PrefetchState.exchanged` when the rows are in the cache.

    ``t``: the iteration prepared (``step`` its plan step), None for a write-back after the last one.
    Several trainers: ``fetch_ids`` are the prefetched rows this trainer holds (``fetch_holders`` their
    holders), ``prefetch_ids`` all of them, ``holders`` theirs (bit w: trainer w), ``fetcher`` the trainer
    that fetches each from the shards and hands it to its holders, ``fetched_here`` those this trainer fetches."""

    t: int | None
    step: Any
    write_ids: np.ndarray
    write_slots: np.ndarray
    fetch_ids: np.ndarray
    fetch_slots: np.ndarray
    fetcher: np.ndarray | None = None
    fetched_here: np.ndarray | None = None
    prefetch_ids: np.ndarray | None = None
    holders: np.ndarray | None = None
    fetch_holders: np.ndarray | None = None


@dataclass(frozen=True)
class Finished:
    """Action: every iteration is prepared and every eviction written home; the worker ends."""


Action = ReadPlan | WaitForDone | Exchange | Finished


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else EMPTY_IDS


class PrefetchState:
    """The plan cursor, the worker's cache view and the pending evictions (see the module docstring).

    ``start``: the first iteration to prepare; ``cached``: the (ids, slots) in the cache at ``start``,
    whose write-backs are all applied (a resume, or a replay after a lost shard)."""

    def __init__(self, iterations: int, distance: int, total_rows: int, num_slots: int, *, start: int = 0,
                 cached: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        if distance < 1:
            raise ValueError(f"prefetch distance must be >= 1, got {distance}")
        self.iterations, self.distance = iterations, distance
        self.slot_of = np.full(total_rows, -1, dtype=np.int64)
        self.owner = np.full(num_slots, -1, dtype=np.int64)
        self.held = 0  # rows in the cache as the worker places them: fetched in, and not yet taken out
        if cached is not None:
            self.slot_of[cached[0]] = cached[1]
            self.owner[cached[1]] = cached[0]
            self.held = len(cached[0])
        self.peak_held = self.held
        self.start = start
        self.t = start  # the next iteration to prepare
        self.written = start  # iterations whose evictions are taken (home, or going home in the next exchange)
        self.plan_step: Any = None  # iteration t's plan step, once read
        self.posted: deque[Done] = deque()  # posted by compute, not yet taken
        self.unsent: list[tuple[np.ndarray, np.ndarray]] = []  # taken (ids, slots), not yet in an exchange
        self.waiting = False  # the last step was a WaitForDone, not yet answered by evictions_taken
        self.in_flight: Exchange | None = None
        self.doing = ""  # what the worker is doing, for an error message: "while ..."

    # ---- queries ------------------------------------------------------------------------------------
    def has_posted(self) -> bool:
        return bool(self.posted)

    def idle(self) -> bool:
        """The worker waits for evictions compute has not posted: every posted eviction is written home
        and no round trip is in flight (a checkpoint may read the cache and the shards)."""
        return self.waiting and not self.posted

    def draining(self) -> bool:
        """Every iteration is prepared: what is left is writing back the last evictions."""
        return self.t >= self.iterations

    # ---- events -------------------------------------------------------------------------------------
    def step(self) -> Action:
        """What the worker does next."""
        if self.in_flight is not None:
            raise RuntimeError(f"the exchange for iteration {self.in_flight.t} is still in flight")
        if self.t < self.iterations:
            if self.plan_step is None:
                self.doing = f"while preparing iteration {self.t}"
                return ReadPlan(self.t)
            if self.written < self.t - self.distance:  # in steady state exactly one: iteration t - P - 1
                self.waiting = True
                return WaitForDone(self.written)
            self.doing = f"while writing back evictions and prefetching for iteration {self.t}"
            ids = np.asarray(self.plan_step.prefetch_ids, dtype=np.int64)
            slots = np.asarray(self.plan_step.prefetch_slots, dtype=np.int64)
            self._check_prefetch(self.t, ids, slots)
            return self._issue(self.t, self.plan_step, ids, slots)
        if self.unsent:
            return self._issue(None, None, EMPTY_IDS, EMPTY_IDS)
        if self.written < self.iterations:
            self.waiting = True
            return WaitForDone(self.written)
        return Finished()

    def plan_read(self, step: Any) -> None:
        """The plan yielded ``step`` (with ``t``, ``prefetch_ids``, ``prefetch_slots``) after a :class:`ReadPlan`."""
        if step.t != self.t:
            raise PlanViolation(f"the plan yielded iteration {step.t} where {self.t} was expected")
        self.plan_step = step

    def evictions_posted(self, done: Done) -> None:
        """Compute finished iteration ``done.t`` (posted in iteration order); the worker takes them when needed."""
        self.posted.append(done)

    def evictions_taken(self) -> CopyOut:
        """After a :class:`WaitForDone`, with evictions posted: the worker takes the oldest. Their slots and
        ids are free from now on (their copies go home in the next exchange, before its fetches, so that
        exchange may reuse them without a stale read)."""
        if not self.waiting or not self.posted:
            raise RuntimeError("evictions taken without a WaitForDone answered by compute")
        self.waiting = False
        done = self.posted.popleft()
        if self.draining():
            self.doing = f"while writing back the evictions of iteration {done.t}"
        ids, slots = done.evict_ids, done.evict_slots
        if not np.array_equal(self.slot_of[ids], slots):
            raise PlanViolation(f"iteration {done.t}: evicted rows are not where the worker put them")
        write_ids, write_slots = self._writes_of(done)
        self.slot_of[ids] = -1
        self.owner[slots] = -1
        self._released(slots)
        self.held -= len(ids)
        self.written += 1
        self.unsent.append((write_ids, write_slots))
        return CopyOut(done, write_ids, write_slots)

    def exchanged(self, exchange: Exchange) -> None:
        """The round trip of ``exchange`` is done and its fetched rows are in their slots."""
        if exchange is not self.in_flight:
            raise RuntimeError("an exchange reported that the state did not issue (or twice)")
        self.in_flight = None
        if len(exchange.fetch_ids):
            self.slot_of[exchange.fetch_ids] = exchange.fetch_slots
            self.owner[exchange.fetch_slots] = exchange.fetch_ids
            self.held += len(exchange.fetch_ids)
            self.peak_held = max(self.peak_held, self.held)
        if exchange.t is not None:
            self.t += 1
            self.plan_step = None

    # ---- the rules ----------------------------------------------------------------------------------
    def _writes_of(self, done: Done) -> tuple[np.ndarray, np.ndarray]:
        """The evicted rows this worker writes home: all of them."""
        return done.evict_ids, done.evict_slots

    def _released(self, slots: np.ndarray) -> None:
        """``slots`` are free (the plan reuses them by number)."""

    def _issue(self, t: int | None, step: Any, ids: np.ndarray, slots: np.ndarray) -> Exchange:
        if t is None and len(self.unsent) == 1:  # after the last iteration: one exchange per iteration's evictions
            write_ids, write_slots = self.unsent[0]
        else:
            write_ids = _joined([w[0] for w in self.unsent])
            write_slots = _joined([w[1] for w in self.unsent])
        self.unsent = []
        self.waiting = False
        self.in_flight = self._exchange(t, step, write_ids, write_slots, ids, slots)
        return self.in_flight

    def _exchange(self, t, step, write_ids, write_slots, ids, slots) -> Exchange:
        return Exchange(t, step, write_ids, write_slots, ids, slots)

    def _check_prefetch(self, t: int, ids: np.ndarray, slots: np.ndarray) -> None:
        if len(ids) != len(slots):
            raise PlanViolation(f"iteration {t}: {len(ids)} prefetch ids but {len(slots)} slots")
        if len(np.unique(slots)) != len(slots):
            raise PlanViolation(f"iteration {t}: two prefetched rows share a cache slot")
        busy = self.owner[slots] >= 0
        if busy.any():
            raise PlanViolation(
                f"iteration {t}: slot {int(slots[busy][0])} is reused before its row "
                f"(id {int(self.owner[slots[busy][0]])}) was written back"
            )
        live = self.slot_of[ids] >= 0
        if live.any():
            raise PlanViolation(
                f"iteration {t}: id {int(ids[live][0])} is prefetched while its previous copy is still "
                "cached or not yet written back (a stale read)"
            )


class PartitionedPrefetchState(PrefetchState):
    """The state of trainer ``rank`` of ``size`` sharing one plan (the LRPP cache): it holds the prefetched rows
    whose holders include it (a plan step's ``holders``, one mask per prefetched row; without them every trainer
    holds every row), in slots of its own cache (``num_slots`` rows, taken from a pool as rows come in and given
    back as they are taken out), writes home the evicted rows ``Done.writers`` gives it and fetches the rows
    :meth:`fetchers` gives it, for their holders. Every trainer runs the same plan through the same rules, so
    they agree on who fetches, holds and writes each row."""

    def __init__(self, iterations: int, distance: int, total_rows: int, num_slots: int, *, size: int, rank: int,
                 gateway: bool = False, start: int = 0, cached: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        super().__init__(iterations, distance, total_rows, num_slots, start=start, cached=cached)
        self.size, self.rank, self.gateway = size, rank, gateway
        self.last_writer = np.full(total_rows, -1, dtype=np.int16)  # -1: never written home by a trainer
        free = np.flatnonzero(self.owner < 0)[::-1]  # a stack: the lowest slot is taken first
        self._free, self._free_count = np.empty(num_slots, dtype=np.int64), len(free)
        self._free[:len(free)] = free

    def fetchers(self, ids: np.ndarray) -> np.ndarray:
        """The trainer that fetches each of ``ids``: the one that last wrote it home, else ``id % W``
        (``gateway``: trainer 0, always). A trainer's write and its own later fetch go to the same server
        in order, so no fetch overtakes the write it must see, whatever the other trainers' timing."""
        if self.gateway:
            return np.zeros(len(ids), dtype=np.int64)
        last = self.last_writer[ids]
        return np.where(last >= 0, last, ids % self.size)

    def _writes_of(self, done: Done) -> tuple[np.ndarray, np.ndarray]:
        evicted = done.evict_ids if done.evicted is None else done.evicted
        self.last_writer[evicted] = done.writers
        mine = evicted[done.writers == self.rank]
        slots = self.slot_of[mine]
        if (slots < 0).any():
            raise PlanViolation(f"iteration {done.t}: trainer {self.rank} is to write home id "
                                f"{int(mine[slots < 0][0])}, which it does not hold")
        return mine, slots

    def _released(self, slots: np.ndarray) -> None:
        self._free[self._free_count:self._free_count + len(slots)] = slots[::-1]
        self._free_count += len(slots)

    def _take_slots(self, t: int, count: int) -> np.ndarray:
        if count > self._free_count:
            raise PlanViolation(f"iteration {t}: trainer {self.rank} holds more rows than its cache of "
                                f"{len(self.owner)} (holders made for another plan or batches?)")
        self._free_count -= count
        return self._free[self._free_count:self._free_count + count][::-1].copy()

    def _check_prefetch(self, t: int, ids: np.ndarray, slots: np.ndarray) -> None:
        """Only a held row has a copy here to check; the slots are this trainer's own (:meth:`_take_slots`)."""

    def _exchange(self, t, step, write_ids, write_slots, ids, slots) -> Exchange:
        fetcher = self.fetchers(ids)
        holders = getattr(step, "holders", None)
        holders = np.full(len(ids), (1 << self.size) - 1, dtype=np.int64) if holders is None else \
            np.asarray(holders, dtype=np.int64)
        mine = (holders >> self.rank) & 1 == 1
        held = ids[mine]
        live = self.slot_of[held] >= 0
        if live.any():
            raise PlanViolation(f"iteration {t}: id {int(held[live][0])} is prefetched while its previous copy is "
                                "still cached or not yet written back (a stale read)")
        return Exchange(t, step, write_ids, write_slots, held, self._take_slots(t, len(held)), fetcher,
                        ids[fetcher == self.rank], ids, holders, holders[mine])
