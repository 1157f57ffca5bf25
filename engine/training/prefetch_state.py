"""The oracle prefetch worker's state, and the only code that changes it.

:class:`PrefetchState` holds the plan cursor (the next iteration to prepare, ``t``; the iterations
whose evictions are taken, ``written``), the worker's view of the cache (``directory``: a
row occupies its slot from its prefetch until its eviction is taken, and its copy then goes home in
the next exchange, which the shards apply before that exchange's fetches), the evictions compute
posted and the worker has not taken yet, and the taken ones not yet sent. Events come in as named
transitions (:meth:`~PrefetchState.plan_read`, :meth:`~PrefetchState.evictions_posted`,
:meth:`~PrefetchState.evictions_taken`, :meth:`~PrefetchState.exchanged`); what the worker must do
next comes out of :meth:`~PrefetchState.next_action` as an action (:class:`ReadPlan`,
:class:`WaitForDone`, :class:`Exchange` or, for one of W trainers, :class:`SharedExchange`,
:class:`Finished`), and :meth:`~PrefetchState.evictions_taken` answers with the rows
to copy out of the cache (:class:`CopyOut`). No threads, no streams, no network: the driver
(:class:`~dlrmflow.engine.training.prefetch.PrefetchWorker`) holds its lock around every call, moves
the data and reports what it did. Attributes are read-only outside this class.

The rules, for prefetch distance ``P`` (docs/planner.md argues them):

- the exchange for iteration ``t`` is issued once the evictions of ``0 .. t-P-1`` are taken
  (``written >= t - P``; in steady state it waits for those of ``t-P-1``), and it writes them home
  before it fetches. So a row evicted after ``u`` is home before any fetch issued for
  ``t >= u + P + 1``: no stale read;
- the worker places rows in slots of its own choosing (a pool: a slot is taken when its row is fetched
  and given back when the row's eviction is taken), and tells compute where (``Exchange.ready_slots``);
  the plan's slot numbers only say where a restart finds the rows cached before it;
- a plan step that would fetch a row whose newer copy is still cached or not yet sent, hold more rows
  than the cache, or evict rows not where the worker put them raises :class:`PlanViolation`;
- fewer round trips (one trainer): the exchange for ``t`` also fetches the rows of ``t + 1 .. t + P - 1``
  whose id is not cached in the worker's view (so no copy of them is newer than the home's, or it is
  among this exchange's write-backs, which the shards apply first), and an exchange with no row of its
  own to fetch is not sent: its write-backs wait for the next exchange that fetches (every exchange
  that fetches carries every write-back taken before it), or for a flush
  (:meth:`~PrefetchState.flush_requested`: a checkpoint reads the shards), or for the end. So in steady
  state one exchange can serve ``P`` iterations. Not further ahead: behind a slow link compute waits for
  the exchange for ``t``, and the next one (``t + P``) may go as soon as ``t - 1`` is computed, so the
  link never idles for it. A plan fills its cache (in steady state the rows of ``t + 1`` need the slots
  that the evictions taken just before ``t + 1``'s exchange free), so rows are fetched early only into
  ``spare_slots`` cache rows beyond the plan's: at most that many are held early at once, so the rows the
  plan fetches on time always find a slot.

:class:`PartitionedPrefetchState` adds the rules of one of W trainers holding the same slots (the
LRPP cache): which trainer fetches each row (the one that last wrote it home while that write may still be
on its way, else ``id % W``; ``gateway``: trainer 0) and which evicted rows this trainer writes home (those
``Done.writers`` gives it). A write is on its way only briefly: the evictions of ``u`` go home in the writer's
exchange for ``u + P + 1``, and trainer ``B`` issues its exchange for ``t`` only after computing ``t - P - 1``,
whose dense-gradient collective every trainer joins only with its exchange for ``t - P - 1`` done (exchanges
are sequential). So a write of ``u``'s evictions is home before any exchange for ``t >= u + 2P + 2`` is
issued, and the state remembers the writers of the last ``2 * (2P + 1)`` iterations' evictions (twice what
the argument needs), not one per embedding row: O(window), and a fetch after that may go to any trainer.
It neither fetches early nor holds write-backs: which rows a trainer could fetch early would depend on its
own slots, and its fetches are handed to other trainers in collectives that all of them issue alike.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from dlrmflow.engine.training.slot_directory import SlotDirectory

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
    """Action (one trainer): one round trip per shard that writes ``write_ids`` home (the rows copied out for
    them, in the order of the :class:`CopyOut` answers since the last exchange) and then fetches ``fetch_ids``
    into ``fetch_slots``; report :meth:`PrefetchState.exchanged` when the rows are in the cache.

    ``t``: the iteration prepared (``plan`` its plan step), None for a write-back after the last one or a
    flush. The last ``ahead`` of ``fetch_ids`` are rows of later iterations fetched early; ``ready_ids`` /
    ``ready_slots`` are every row prefetched for ``t`` (some fetched by the exchange before); ``sends_writes``:
    False when the exchange fetches nothing and its write-backs wait (``write_ids`` empty)."""

    t: int | None
    plan: Any
    write_ids: np.ndarray
    write_slots: np.ndarray
    fetch_ids: np.ndarray
    fetch_slots: np.ndarray
    ahead: int = 0
    ready_ids: np.ndarray | None = None
    ready_slots: np.ndarray | None = None
    sends_writes: bool = True

    def handed_over(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
        """What compute gets for ``t``: every row prefetched for it, their slots, their holders (None: one
        trainer) and how many of them this exchange fetched."""
        return self.ready_ids, self.ready_slots, None, len(self.ready_ids)


@dataclass(frozen=True, eq=False)
class SharedExchange:
    """Action (one of W trainers sharing a plan): a round trip per shard for this trainer's share, writing
    ``write_ids`` home and fetching ``fetched_here``, then the rows handed between trainers: ``prefetch_ids``
    are every row prefetched for ``t``, ``holders`` theirs (bit w: trainer w), ``fetcher`` the trainer that
    fetches each from the shards and hands it to its holders; ``fetch_ids`` (into ``fetch_slots``) are those
    this trainer holds, ``fetch_holders`` their holders. ``t``/``plan`` as :class:`Exchange`'s."""

    t: int | None
    plan: Any
    write_ids: np.ndarray
    write_slots: np.ndarray
    fetch_ids: np.ndarray
    fetch_slots: np.ndarray
    fetcher: np.ndarray
    fetched_here: np.ndarray
    prefetch_ids: np.ndarray
    holders: np.ndarray
    fetch_holders: np.ndarray
    sends_writes = True  # (never held: module docstring)

    def handed_over(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
        """What compute gets for ``t``: the rows this trainer holds, their slots and holders, and how many of
        them it fetched from the shards itself."""
        return self.fetch_ids, self.fetch_slots, self.fetch_holders, len(self.fetched_here)


@dataclass(frozen=True)
class Finished:
    """Action: every iteration is prepared and every eviction written home; the worker ends."""


Action = ReadPlan | WaitForDone | Exchange | SharedExchange | Finished


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else EMPTY_IDS


class PrefetchState:
    """The plan cursor, the worker's cache view and the pending evictions (see the module docstring).

    ``start``: the first iteration to prepare; ``cached``: the (ids, slots) in the cache at ``start``,
    whose write-backs are all applied (a resume, or a replay after a lost shard). ``spare_slots``: cache rows
    beyond the plan's ``num_slots``, so many rows may be held fetched early at once."""

    fetches_early = True  # fetch rows of t + 1 .. t + P - 1 in t's exchange, hold write-backs (module docstring)

    def __init__(self, iterations: int, distance: int, num_slots: int, *, start: int = 0,
                 cached: tuple[np.ndarray, np.ndarray] | None = None, spare_slots: int = 0) -> None:
        if distance < 1:
            raise ValueError(f"prefetch distance must be >= 1, got {distance}")
        self.iterations, self.distance = iterations, distance
        self.directory = SlotDirectory(num_slots + spare_slots)  # the worker's view of the cache
        self.spare_slots = spare_slots
        self.held = 0  # rows in the cache as the worker places them: fetched in, and not yet taken out
        if cached is not None:
            self.directory.place(cached[0], cached[1])
            self.held = len(cached[0])
        # The most rows held at once, less those fetched early for iterations not prepared yet: what the plan's
        # rule holds (its peak is the plan's num_slots); the others are at most spare_slots.
        self.peak_held = self.held
        free = np.flatnonzero(self.directory.owner < 0)[::-1]  # a stack: the lowest slot is taken first
        self._free, self._free_count = np.empty(len(self.directory.owner), dtype=np.int64), len(free)
        self._free[:len(free)] = free
        self.start = start
        self.t = start  # the next iteration to prepare
        self.written = start  # iterations whose evictions are taken (home, or going home in the next exchange)
        self.plan_step: Any = None  # iteration t's plan step, once read
        self.read_ahead: deque[Any] = deque()  # the plan steps of t + 1 .. t + P - 1 (fetches_early), once read
        # Per later iteration: which prefetches earlier exchanges fetched, and their slots (-1: the others); the
        # same for the exchange in flight.
        self.early: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._early_in_flight: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.flush_wanted = False  # send held write-backs at the next wait with nothing posted
        self.posted: deque[Done] = deque()  # posted by compute, not yet taken
        self.unsent: list[tuple[np.ndarray, np.ndarray]] = []  # taken (ids, slots), not yet in an exchange
        self.waiting = False  # the last action was a WaitForDone, not yet answered by evictions_taken
        self.in_flight: Exchange | SharedExchange | None = None
        self.doing = ""  # what the worker is doing, for an error message: "while ..."

    # ---- queries ------------------------------------------------------------------------------------
    def has_posted(self) -> bool:
        return bool(self.posted)

    def idle(self) -> bool:
        """The worker waits for evictions compute has not posted: every posted eviction is written home
        and no round trip is in flight (a checkpoint may read the cache and the shards). A checkpoint first
        calls :meth:`flush_requested`, or held write-backs keep the worker from being idle."""
        return self.waiting and not self.posted and not self.unsent

    @property
    def rows_fetched_ahead(self) -> int:
        """Rows of iterations not prepared yet that earlier exchanges fetched already."""
        return sum(int(np.count_nonzero(mask)) for mask, _ in self.early.values())

    def draining(self) -> bool:
        """Every iteration is prepared: what is left is writing back the last evictions."""
        return self.t >= self.iterations

    # ---- events -------------------------------------------------------------------------------------
    def next_action(self) -> Action:
        """What the worker does next."""
        if self.in_flight is not None:
            raise RuntimeError(f"the exchange for iteration {self.in_flight.t} is still in flight")
        if self.t < self.iterations:
            if self.plan_step is None:
                self.doing = f"while preparing iteration {self.t}"
                return ReadPlan(self.t)
            if len(self.read_ahead) < self._window():
                return ReadPlan(self.t + 1 + len(self.read_ahead))
            if self.written < self.t - self.distance:  # in steady state exactly one: iteration t - P - 1
                return self._wait()
            self.doing = f"while writing back evictions and prefetching for iteration {self.t}"
            ids = np.asarray(self.plan_step.prefetch_ids, dtype=np.int64)
            self._check_prefetch(self.t, ids, np.asarray(self.plan_step.prefetch_slots, dtype=np.int64))
            return self._issue(self.t, self.plan_step, self._not_in_place(self.t, ids))
        if self.unsent:
            return self._issue(None, None, EMPTY_IDS)
        if self.written < self.iterations:
            return self._wait()
        return Finished()

    def _wait(self) -> WaitForDone | Exchange | SharedExchange:
        """The next step needs evictions not taken yet: wait for them, unless a flush is wanted and nothing is
        posted (then the held write-backs go first)."""
        if self.flush_wanted and not self.posted:
            self.flush_wanted = False
            if self.unsent:
                self.doing = "while writing back held evictions"
                return self._issue(None, None, EMPTY_IDS)
        self.waiting = True
        return WaitForDone(self.written)

    def _window(self) -> int:
        """How many iterations after ``t`` the exchange for ``t`` may fetch rows of."""
        return min(self.distance - 1, self.iterations - self.t - 1) if self.fetches_early else 0

    def plan_read(self, step: Any) -> None:
        """The plan yielded ``step`` (with ``t``, ``prefetch_ids``, ``prefetch_slots``) after a :class:`ReadPlan`."""
        expected = self.t if self.plan_step is None else self.t + 1 + len(self.read_ahead)
        if step.t != expected:
            raise PlanViolation(f"the plan yielded iteration {step.t} where {expected} was expected")
        if self.plan_step is None:
            self.plan_step = step
        else:
            self.read_ahead.append(step)

    def flush_requested(self) -> None:
        """A checkpoint wants every posted eviction home: unless the worker is idle already, the next time it
        would wait with nothing posted, it sends the write-backs it holds first (then :meth:`idle`). (An idle
        worker takes no request, which would otherwise linger to a point that depends on the timing.)"""
        self.flush_wanted = not self.idle()

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
        if not np.array_equal(self.directory.lookup(ids), slots):
            raise PlanViolation(f"iteration {done.t}: evicted rows are not where the worker put them")
        write_ids, write_slots = self._writes_of(done)
        self.directory.remove(ids)
        self._released(slots)
        self.held -= len(ids)
        self.written += 1
        self.unsent.append((write_ids, write_slots))
        return CopyOut(done, write_ids, write_slots)

    def exchanged(self, exchange: Exchange | SharedExchange) -> None:
        """The round trip of ``exchange`` is done and its fetched rows are in their slots."""
        if exchange is not self.in_flight:
            raise RuntimeError("an exchange reported that the state did not issue (or twice)")
        self.in_flight = None
        if len(exchange.fetch_ids):
            self.directory.place(exchange.fetch_ids, exchange.fetch_slots)
            self.held += len(exchange.fetch_ids)
        if exchange.t is not None:
            self.t += 1
            self.plan_step = self.read_ahead.popleft() if self.read_ahead else None
            self.doing = f"while preparing iteration {self.t}"
            self.early.pop(exchange.t, None)
            self.early.update(self._early_in_flight)
            self._early_in_flight = {}
        self.peak_held = max(self.peak_held, self.held - self.rows_fetched_ahead)

    # ---- the rules ----------------------------------------------------------------------------------
    def _writes_of(self, done: Done) -> tuple[np.ndarray, np.ndarray]:
        """The evicted rows this worker writes home: all of them."""
        return done.evict_ids, done.evict_slots

    def _released(self, slots: np.ndarray) -> None:
        """``slots`` are free: back on the pool."""
        self._free[self._free_count:self._free_count + len(slots)] = slots[::-1]
        self._free_count += len(slots)

    def _take_slots(self, t: int, count: int) -> np.ndarray:
        if count > self._free_count:
            raise PlanViolation(f"iteration {t}: {self._holder()} holds more rows than its cache of "
                                f"{len(self.directory.owner)} ({self._made_for_others()})")
        self._free_count -= count
        return self._free[self._free_count:self._free_count + count][::-1].copy()

    def _holder(self) -> str:
        return "the worker"

    def _made_for_others(self) -> str:
        return "a plan made for other batches?"

    def _issue(self, t: int | None, step: Any, ids: np.ndarray) -> Exchange | SharedExchange:
        """The exchange for ``t`` (None: write-backs only) that fetches ``ids`` (``t``'s rows not in place)."""
        # Sent when t has rows of its own to fetch (an exchange sent just for later rows would be one per
        # iteration again).
        sends = t is None or not self.fetches_early or len(ids) > 0
        write_ids = write_slots = EMPTY_IDS
        if sends:
            if t is None and len(self.unsent) == 1:  # after the last iteration: one exchange per iteration's evictions
                write_ids, write_slots = self.unsent[0]
            else:
                write_ids = _joined([w[0] for w in self.unsent])
                write_slots = _joined([w[1] for w in self.unsent])
            self.unsent = []
        self.waiting = False
        self.in_flight = self._exchange(t, step, write_ids, write_slots, ids, sends)
        return self.in_flight

    def _fetchable_ahead(self, ids: np.ndarray) -> tuple[dict[int, np.ndarray], np.ndarray, np.ndarray]:
        """The prefetches of the steps read ahead that the exchange for ``t`` (which fetches ``ids``) fetches too:
        their id is not cached in the worker's view, nor fetched by this exchange or claimed by an earlier step
        read ahead (a valid plan claims none twice; a bad one is then checked at its own iteration), within the
        spare slots' budget, in plan order. A row whose write-back is held goes home in that exchange, before
        its fetches. Per iteration the mask, and all those ids and their slots (taken from the pool)."""
        budget = self.spare_slots - sum(int(np.count_nonzero(m)) for u, (m, _) in self.early.items() if u > self.t)
        masks, claimed, out_ids, out_slots = {}, [ids], [], []
        for step in self.read_ahead:
            step_ids = np.asarray(step.prefetch_ids, dtype=np.int64)
            self._check_shape(step.t, step_ids, np.asarray(step.prefetch_slots, dtype=np.int64))
            before, placed = self.early.get(step.t, (np.zeros(len(step_ids), dtype=bool),
                                                     np.full(len(step_ids), -1, dtype=np.int64)))
            early = (self.directory.lookup(step_ids) < 0) & ~before & ~np.isin(step_ids, np.concatenate(claimed))
            early[np.flatnonzero(early)[max(budget, 0):]] = False
            budget -= int(np.count_nonzero(early))
            placed = placed.copy()
            placed[early] = self._take_slots(step.t, int(np.count_nonzero(early)))
            masks[step.t] = (before | early, placed)
            claimed.append(step_ids)
            out_ids.append(step_ids[early])
            out_slots.append(placed[early])
        return masks, _joined(out_ids), _joined(out_slots)

    def _exchange(self, t, step, write_ids, write_slots, ids, sends: bool) -> Exchange:
        """The state's choice of slots: ``t``'s rows not in place into slots from the pool, then (if the exchange
        is sent) the rows fetched early."""
        ready_ids = ready_slots = None
        slots = self._take_slots(t, len(ids))  # (none after the last iteration)
        ahead_ids = ahead_slots = EMPTY_IDS
        if t is not None and sends and self.read_ahead:
            self._early_in_flight, ahead_ids, ahead_slots = self._fetchable_ahead(ids)
        if step is not None:
            ready_ids = np.asarray(step.prefetch_ids, dtype=np.int64)
            mask, placed = self.early.get(t, (np.zeros(len(ready_ids), dtype=bool), None))
            ready_slots = np.empty(len(ready_ids), dtype=np.int64)
            ready_slots[~mask] = slots
            if placed is not None:
                ready_slots[mask] = placed[mask]
        return Exchange(t, step, write_ids, write_slots, np.concatenate([ids, ahead_ids]),
                        np.concatenate([slots, ahead_slots]), ahead=len(ahead_ids), ready_ids=ready_ids,
                        ready_slots=ready_slots, sends_writes=sends)

    def _not_in_place(self, t: int, ids: np.ndarray) -> np.ndarray:
        """``t``'s prefetches ``ids`` less those earlier exchanges fetched early (in place already)."""
        return ids[~self.early[t][0]] if t in self.early else ids

    def _check_shape(self, t: int, ids: np.ndarray, slots: np.ndarray) -> None:
        if len(ids) != len(slots):
            raise PlanViolation(f"iteration {t}: {len(ids)} prefetch ids but {len(slots)} slots")
        if len(np.unique(slots)) != len(slots):
            raise PlanViolation(f"iteration {t}: two prefetched rows share a cache slot")

    def _check_prefetch(self, t: int, ids: np.ndarray, slots: np.ndarray) -> None:
        """``t``'s prefetches (those earlier exchanges fetched early were checked then, and are placed)."""
        self._check_shape(t, ids, slots)
        ids = self._not_in_place(t, ids)
        live = self.directory.lookup(ids) >= 0
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

    fetches_early = False  # (module docstring)

    def __init__(self, iterations: int, distance: int, num_slots: int, *, size: int, rank: int,
                 gateway: bool = False, start: int = 0, cached: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        super().__init__(iterations, distance, num_slots, start=start, cached=cached)
        self.size, self.rank, self.gateway = size, rank, gateway
        # The writers of the evictions of the last ``remembered`` iterations, oldest first: (u, ids, writers).
        # Before ``start`` nothing is on its way (a run starts, resumes or restarts with every write home).
        self.remembered = 2 * (2 * distance + 1)
        self.recent_writes: deque[tuple[int, np.ndarray, np.ndarray]] = deque()

    def fetchers(self, ids: np.ndarray) -> np.ndarray:
        """The trainer that fetches each of ``ids`` in the exchange for ``t``: the one that wrote it home last
        if that was among the evictions of the last :attr:`remembered` iterations, else ``id % W``
        (``gateway``: trainer 0, always). A trainer's write and its own later fetch go to the same server
        in order, so no fetch overtakes the write it must see, whatever the other trainers' timing; an
        older write is home already (module docstring)."""
        if self.gateway:
            return np.zeros(len(ids), dtype=np.int64)
        while self.recent_writes and self.recent_writes[0][0] < self.t - self.remembered:
            self.recent_writes.popleft()
        fetcher = ids % self.size
        pending = np.arange(len(ids))  # positions in ids not found in a newer write yet
        for _, written, writers in reversed(self.recent_writes):  # newest first: each id's last writer wins
            if not len(pending):
                break
            at = np.minimum(np.searchsorted(written, ids[pending]), len(written) - 1)
            hit = written[at] == ids[pending]
            fetcher[pending[hit]] = writers[at[hit]]
            pending = pending[~hit]
        return fetcher

    def _writes_of(self, done: Done) -> tuple[np.ndarray, np.ndarray]:
        evicted = done.evict_ids if done.evicted is None else done.evicted
        if len(evicted):  # sorted once here, searched by each fetch of the window
            order = np.argsort(evicted, kind="stable")
            self.recent_writes.append((done.t, np.asarray(evicted, dtype=np.int64)[order],
                                       np.asarray(done.writers, dtype=np.int64)[order]))
        mine = evicted[done.writers == self.rank]
        slots = self.directory.lookup(mine)
        if (slots < 0).any():
            raise PlanViolation(f"iteration {done.t}: trainer {self.rank} is to write home id "
                                f"{int(mine[slots < 0][0])}, which it does not hold")
        return mine, slots

    def _holder(self) -> str:
        return f"trainer {self.rank}"

    def _made_for_others(self) -> str:
        return "holders made for another plan or batches?"

    def _check_prefetch(self, t: int, ids: np.ndarray, slots: np.ndarray) -> None:
        """Only a held row has a copy here to check; the slots are this trainer's own (:meth:`_take_slots`)."""

    def _exchange(self, t, step, write_ids, write_slots, ids, sends: bool) -> SharedExchange:
        fetcher = self.fetchers(ids)
        holders = getattr(step, "holders", None)
        holders = np.full(len(ids), (1 << self.size) - 1, dtype=np.int64) if holders is None else \
            np.asarray(holders, dtype=np.int64)
        mine = (holders >> self.rank) & 1 == 1
        held = ids[mine]
        live = self.directory.lookup(held) >= 0
        if live.any():
            raise PlanViolation(f"iteration {t}: id {int(held[live][0])} is prefetched while its previous copy is "
                                "still cached or not yet written back (a stale read)")
        return SharedExchange(t, step, write_ids, write_slots, held, self._take_slots(t, len(held)), fetcher,
                              ids[fetcher == self.rank], ids, holders, holders[mine])
