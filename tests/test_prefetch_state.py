"""The prefetch worker's state without threads or a cluster: events in, actions out.

A pure-NumPy model of the home (the shards: one value per row), of each trainer's cache (one value per
slot, and which row is physically there) and of compute, drives :class:`PrefetchState` (one trainer) or
W :class:`PartitionedPrefetchState` (one per trainer, the LRPP cache) through the same transitions as
``engine/training/prefetch.py``'s drivers, as generators that take one atomic step at a time. A row's
value is the number of iterations that updated it, so the value every read must see is known:

- no fetch reads a stale row: a fetch issued for ``t`` reads, at the home, the row's value after
  every iteration before ``t``;
- compute reads every row of its batch current, in the slot the plan gave it;
- a slot is never overwritten while its row is still needed (cached for compute, or evicted and not
  yet copied out for its write-back);
- every eviction is written home exactly once (by exactly one trainer), with the value after its
  iteration;
- whenever the worker is idle (a checkpoint's moment), the home overlaid with the cache where the state
  places rows is every row's current value (what ``OracleRows.logical_rows`` reads);
- the state's actions are the same in every interleaving (so training is bit-identical whatever the timing).

The tests enumerate every interleaving of small scenarios (a prefetch, a write-back and an eviction of
the same row and slot, P = 1 and 2, one trainer and W = 2), run random plans under random interleavings
(W = 1, 2, 3, gateway or not, resumed mid-plan or not), and check that bad plans raise
:class:`PlanViolation` with the messages the trainers' tests match. The last ones run the thin drivers
(``PrefetchWorker`` on its thread, on a GPU where there is one; three ``PartitionedPrefetchWorker``)
against an in-memory home and check that their round trips are exactly the state's exchanges.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from dlrmflow.engine.training.prefetch import PartitionedPrefetchWorker, PrefetchWorker
from dlrmflow.engine.training.prefetch_state import (
    EMPTY_IDS,
    CopyOut,
    Done,
    Exchange,
    Finished,
    HeldStep,
    PartitionedPrefetchState,
    PlanViolation,
    PrefetchState,
    ReadPlan,
    SharedExchange,
    WaitForDone,
)

Blocked = Callable[[], bool] | None  # what a step yields: None (done a step) or "run me again once this is true"


@dataclass(frozen=True)
class Step:
    t: int
    prefetch_ids: np.ndarray
    prefetch_slots: np.ndarray
    evict_ids: np.ndarray


def ids(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


@dataclass
class Plan:
    """A plan and the batches it serves: every row iteration ``t`` uses is cached at ``t``."""

    steps: list[Step]
    batches: list[np.ndarray]
    num_slots: int
    total_rows: int
    distance: int

    @property
    def iterations(self) -> int:
        return len(self.steps)

    def uses_before(self) -> np.ndarray:
        """``[T + 1, total_rows]``: how many iterations before ``u`` used each row (a row's value before ``u``)."""
        counts = np.zeros((self.iterations + 1, self.total_rows), dtype=np.int64)
        for u, batch in enumerate(self.batches):
            counts[u + 1] = counts[u]
            counts[u + 1, batch] += 1
        return counts

    def cached_at(self, start: int) -> tuple[np.ndarray, np.ndarray]:
        """The (ids, slots) the plan implies in the cache before ``start`` (as ``OracleRows.restart_at`` replays it)."""
        slot_of = np.full(self.total_rows, -1, dtype=np.int64)
        for step in self.steps[:start]:
            slot_of[step.prefetch_ids] = step.prefetch_slots
            slot_of[step.evict_ids] = -1
        cached = np.flatnonzero(slot_of >= 0)
        return cached, slot_of[cached]


def scripted_plan(batches: list[list[int]], slots: dict[tuple[int, int], int], distance: int,
                  num_slots: int = 4, total_rows: int = 4) -> Plan:
    """A plan by hand: a row is prefetched where ``slots`` names it ((t, id) -> slot) and evicted after its
    last use in a run of consecutive uses."""
    steps = []
    for t, batch in enumerate(batches):
        fetch = sorted(x for (u, x) in slots if u == t)
        evict = [x for x in batch if t + 1 >= len(batches) or x not in batches[t + 1]]
        steps.append(Step(t, ids(*fetch), ids(*(slots[t, x] for x in fetch)), ids(*sorted(evict))))
    return Plan(steps, [ids(*sorted(b)) for b in batches], num_slots, total_rows, distance)


def random_plan(rng: np.random.Generator, iterations: int, total_rows: int, lookahead: int, distance: int) -> Plan:
    """The planner's window rule on random batches: a row is prefetched when its gap is > L (or it is new)
    and evicted when its next use is after ``t + L``; slots are picked at random among those free at the
    worker's timing (the evictions of ``t - P - 1`` free theirs before the fetches for ``t``). With
    ``L < P`` the plan can refetch a row that the worker still holds (a bad plan)."""
    batches = [np.unique(rng.integers(0, total_rows, int(rng.integers(1, 5)))) for _ in range(iterations)]
    uses = [set(b.tolist()) for b in batches]
    fetch: list[list[int]] = [[] for _ in range(iterations)]
    evict: list[list[int]] = [[] for _ in range(iterations)]
    for x in range(total_rows):
        times = [t for t in range(iterations) if x in uses[t]]
        for i, t in enumerate(times):
            if i == 0 or t - times[i - 1] > lookahead:
                fetch[t].append(x)
            if i + 1 == len(times) or times[i + 1] > t + lookahead:
                evict[t].append(x)
    # A valid plan holds at most one copy of a row: few spare slots, so slots are reused often.
    num_slots = total_rows + 1 if lookahead >= distance else total_rows * (distance + 2)
    free = set(range(num_slots))
    held: dict[tuple[int, int], int] = {}  # (iteration fetched, id) -> slot
    slot_at: dict[int, list[int]] = {}  # iteration evicted -> slots freed
    steps = []
    for t in range(iterations):
        if t - distance - 1 >= 0:
            free |= set(slot_at.pop(t - distance - 1, []))
        chosen = rng.permutation(sorted(free))[: len(fetch[t])]
        free -= set(chosen.tolist())
        for x, s in zip(fetch[t], chosen.tolist(), strict=True):
            held[t, x] = int(s)
        for x in evict[t]:  # the copy fetched most recently
            fetched = max(u for (u, y) in held if y == x and u <= t)
            slot_at.setdefault(t, []).append(held.pop((fetched, x)))
        steps.append(Step(t, ids(*fetch[t]), ids(*chosen.tolist()), ids(*sorted(evict[t]))))
    return Plan(steps, batches, num_slots, total_rows, distance)


def refetched_too_early(plan: Plan) -> bool:
    """The reference rule: some row evicted after ``p`` is fetched again for a ``t <= p + P`` (before the
    worker has taken ``p``'s evictions)."""
    evicted_at: dict[int, int] = {}
    for step in plan.steps:
        for x in step.prefetch_ids.tolist():
            if x in evicted_at and step.t <= evicted_at[x] + plan.distance:
                return True
        for x in step.evict_ids.tolist():
            evicted_at[x] = step.t
    return False


def random_holders(plan: Plan, size: int, rng: np.random.Generator, *, gateway: bool = False, every: bool = False
                   ) -> tuple[list[HeldStep], list[np.ndarray], list[np.ndarray]]:
    """Random holders for every lifetime of ``plan`` (``every``: all trainers; ``gateway``: trainer 0 among them):
    the steps with their masks, per iteration the holders of each row cached there (0: not cached), and per
    iteration a writer among the holders of each evicted row (``gateway``: trainer 0)."""
    full = (1 << size) - 1
    current = np.zeros(plan.total_rows, dtype=np.int64)
    steps, holder_at, writers = [], [], []
    for step in plan.steps:
        masks = np.full(len(step.prefetch_ids), full) if every else rng.integers(1, full + 1, len(step.prefetch_ids))
        masks = masks | (1 if gateway else 0)
        current[step.prefetch_ids] = masks
        holder_at.append(current.copy())
        bits = [rng.choice([w for w in range(size) if m >> w & 1]) for m in current[step.evict_ids].tolist()]
        writers.append(np.zeros(len(bits), np.int64) if gateway else np.array(bits, dtype=np.int64))
        current[step.evict_ids] = 0
        steps.append(HeldStep(step, masks))
    return steps, holder_at, writers


# ---- the model ------------------------------------------------------------------------------------------
class System:
    """The home, W trainers (cache, state, worker and compute generators) and the invariants."""

    def __init__(self, plan: Plan, *, size: int = 1, start: int = 0, gateway: bool = False, seed: int = 0,
                 writers: list[np.ndarray] | None = None, steps: list[Step] | None = None,
                 holders: bool = False, checkpoints: frozenset[int] = frozenset(), spare_slots: int = 0) -> None:
        """``holders``: each lifetime is held by a random set of trainers (the plan's steps then carry their
        masks, and a trainer reads only the rows it holds); else every trainer holds every row.
        ``checkpoints`` (one trainer): after posting these iterations compute waits until the worker is idle,
        having asked it to flush (what ``OracleRows`` does before a checkpoint). ``spare_slots`` (one trainer):
        the cache's slots beyond the plan's, for rows fetched early."""
        self.plan, self.size, self.start, self.checkpoints = plan, size, start, checkpoints
        self.before = plan.uses_before()
        rng = np.random.default_rng(seed)
        held_steps, self.holder_at, random_writers = random_holders(plan, size, rng, gateway=gateway,
                                                                     every=not holders)
        # what the plan yields (a bad plan: other steps)
        self.steps = (held_steps if holders else plan.steps) if steps is None else steps
        writers = random_writers if writers is None else writers
        self.writers = writers
        self.home = self.before[start].copy()  # a resume: the checkpoint's rows, restored to the shards
        cached_all, slots_all = plan.cached_at(start)
        self.states: list[PrefetchState] = []
        self.cache, self.cache_id, self.needed = [], [], []
        self.compute_slot_of: list[np.ndarray] = []
        self.placed: list[dict[int, tuple[np.ndarray, np.ndarray]]] = [{} for _ in range(size)]
        for w in range(size):
            args = (plan.iterations, plan.distance, plan.num_slots)
            mine = (self.holder_at[start - 1][cached_all] >> w & 1) == 1 if start else np.zeros(0, dtype=bool)
            cached, cached_slots = cached_all[mine], slots_all[mine]
            if size == 1 and not gateway:
                state = PrefetchState(*args, start=start, cached=(cached.copy(), cached_slots.copy()),
                                      spare_slots=spare_slots)
            else:
                state = PartitionedPrefetchState(*args, size=size, rank=w, gateway=gateway, start=start,
                                                 cached=(cached.copy(), cached_slots.copy()))
            self.states.append(state)
            cache = np.full(plan.num_slots + spare_slots, -1, dtype=np.int64)
            cache[cached_slots] = self.before[start][cached]
            cache_id = np.full(plan.num_slots + spare_slots, -1, dtype=np.int64)
            cache_id[cached_slots] = cached
            needed = cache_id >= 0
            self.cache.append(cache)
            self.cache_id.append(cache_id)
            self.needed.append(needed)
            slot_of = np.full(plan.total_rows, -1, dtype=np.int64)
            slot_of[cached] = cached_slots
            self.compute_slot_of.append(slot_of)
        self.ready: list[set[int]] = [set() for _ in range(size)]
        self.worker_done = [False] * size
        self.computed = [start] * size  # iterations whose update is in the cache
        self.entered = [start] * size  # iterations whose rows are ready and whose collective it joined
        self.posted = [start] * size  # iterations whose evictions are posted
        self.unsent: list[list[np.ndarray]] = [[] for _ in range(size)]
        self.gathered: dict[int, dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
        self.writes = np.zeros(plan.total_rows, dtype=np.int64)  # write-backs per row, all trainers
        self.actions: list[list[tuple]] = [[] for _ in range(size)]
        self.errors: list[BaseException | None] = [None] * size
        self.gens: list[Iterator[Blocked]] = []
        for w in range(size):
            self.gens += [self.worker(w), self.compute(w)]
        self.blocks: dict[int, Blocked] = {}
        self.number = {id(g): n for n, g in enumerate(self.gens)}
        self.progress = [0] * len(self.gens)  # steps taken, per generator

    # ---- the worker (what PrefetchWorker / PartitionedPrefetchWorker do) --------------------------------
    def worker(self, w: int) -> Iterator[Blocked]:
        try:
            yield from self._work(w)
        except PlanViolation as exc:
            self.errors[w] = exc

    def _work(self, w: int) -> Iterator[Blocked]:
        state, cache, cache_id, needed = self.states[w], self.cache[w], self.cache_id[w], self.needed[w]
        while True:
            action = state.next_action()
            self.actions[w].append(summary(action))
            if isinstance(action, Finished):
                self.worker_done[w] = True
                return
            if isinstance(action, ReadPlan):  # (no other generator sees the plan: no step of its own)
                state.plan_read(self.steps[action.t])
            elif isinstance(action, WaitForDone):
                assert state.waiting
                self.actions[w].pop()  # recorded once answered: a flush may come first (timing)
                yield lambda: state.has_posted() or state.flush_wanted
                if not state.has_posted():
                    continue  # a checkpoint wants the held write-backs: the state sends them next
                self.actions[w].append(summary(action))
                take = state.evictions_taken()
                assert isinstance(take, CopyOut) and not state.waiting
                self.actions[w].append(summary(take))
                done = take.done
                assert np.array_equal(cache_id[take.slots], take.ids), "the copy is taken from the wrong slots"
                values = cache[take.slots].copy()
                # The copy is taken after compute's last update of the row.
                assert np.array_equal(values, self.before[done.t + 1][take.ids])
                if self.size > 1:
                    evicted = done.evict_ids if done.evicted is None else done.evicted
                    assert np.array_equal(take.ids, evicted[done.writers == w])
                needed[done.evict_slots] = False
                self.unsent[w].append(values)
            else:
                assert isinstance(action, Exchange | SharedExchange) and state.in_flight is action
                yield None  # in flight: compute runs on, posts, a checkpoint may look
                rows = EMPTY_IDS
                if action.sends_writes:  # else they wait for the next exchange that fetches
                    rows = np.concatenate(self.unsent[w]) if self.unsent[w] else EMPTY_IDS
                    self.unsent[w] = []
                assert len(rows) == len(action.write_ids)
                # One round trip, atomic at the home: the writes first, then the fetches.
                self.home[action.write_ids] = rows
                self.writes[action.write_ids] += 1
                here = action.fetched_here if isinstance(action, SharedExchange) else action.fetch_ids
                if len(here):
                    early = action.ahead if isinstance(action, Exchange) else 0
                    now, ahead = here[:len(here) - early], here[len(here) - early:]
                    assert np.array_equal(self.home[now], self.before[action.t][now]), \
                        f"trainer {w} read a stale row for iteration {action.t}"
                    assert np.array_equal(self.home[ahead], self.before[action.t + 1][ahead]), \
                        f"trainer {w} read a stale row for iteration {action.t + 1}, early"
                fetched = self.home[here].copy()
                values = fetched
                if isinstance(action, SharedExchange) and len(action.prefetch_ids):  # handed to the holders
                    self.gathered.setdefault(action.t, {})[w] = (action.fetcher, here, fetched)
                    mine = (action.holders >> w & 1) == 1
                    by_me = action.fetcher == w
                    # Point to point: a trainer waits for the fetchers of its rows and the holders of its fetches.
                    peers = set(action.fetcher[mine].tolist()) | {
                        h for h in range(self.size) if (action.holders[by_me] >> h & 1).any()}
                    peers.discard(w)
                    yield lambda t=action.t, peers=peers: all(v in self.gathered[t] for v in peers)
                    parts = self.gathered[action.t]
                    assert all(np.array_equal(parts[v][0], action.fetcher) for v in peers), "fetchers disagree"
                    value_of = {x: val for v in peers | {w} for x, val in zip(parts[v][1].tolist(),
                                                                              parts[v][2].tolist(), strict=True)}
                    assert np.array_equal(action.fetch_ids, action.prefetch_ids[mine])
                    values = np.array([value_of[x] for x in action.fetch_ids.tolist()], dtype=np.int64)
                assert not needed[action.fetch_slots].any(), "a slot is overwritten while its row is needed"
                cache[action.fetch_slots] = values
                cache_id[action.fetch_slots] = action.fetch_ids
                needed[action.fetch_slots] = True
                state.exchanged(action)
                if action.t is not None:
                    self.placed[w][action.t] = action.handed_over()[:2]
                    self.ready[w].add(action.t)
                yield None

    # ---- compute (what the oracle store and the trainer do) ---------------------------------------------
    def compute(self, w: int) -> Iterator[Blocked]:
        cache, cache_id, slot_of = self.cache[w], self.cache_id[w], self.compute_slot_of[w]
        for u in range(self.start, self.plan.iterations):
            yield lambda u=u: u in self.ready[w] or self.errors[w] is not None
            if self.errors[w] is not None:
                return  # wait_ready re-raises the worker's failure
            if self.size > 1:  # the dense gradients' collective: no trainer ends u before every one has u's rows
                self.entered[w] = u + 1
                yield lambda u=u: all(e > u for e in self.entered) or any(e is not None for e in self.errors)
                if any(e is not None for e in self.errors):
                    return  # the collective fails with the trainer whose worker failed
            step = self.plan.steps[u]
            placed_ids, placed_slots = self.placed[w].pop(u)
            slot_of[placed_ids] = placed_slots
            batch = self.plan.batches[u]
            batch = batch[(self.holder_at[u][batch] >> w & 1) == 1]  # this trainer's rows (its holders' copies)
            slots = slot_of[batch]
            assert (slots >= 0).all() and np.array_equal(cache_id[slots], batch), f"iteration {u}: rows missing"
            assert np.array_equal(cache[slots], self.before[u][batch]), f"iteration {u} read a stale row"
            cache[slots] += 1
            self.computed[w] = u + 1
            if self.size == 1:  # several trainers: the update and the post in one step (see check)
                yield None
            evict = step.evict_ids[(self.holder_at[u][step.evict_ids] >> w & 1) == 1]  # those it holds
            evict_slots = slot_of[evict]
            slot_of[evict] = -1
            self.states[w].evictions_posted(Done(u, evict, evict_slots, None,
                                                 self.writers[u] if self.size > 1 else None,
                                                 step.evict_ids if self.size > 1 else None))
            self.posted[w] = u + 1
            yield None
            if u in self.checkpoints:
                self.states[w].flush_requested()
                yield lambda: self.states[w].idle() or self.worker_done[w] or self.errors[w] is not None

    # ---- running it -------------------------------------------------------------------------------------
    def ready_gens(self) -> list[Iterator[Blocked]]:
        return [g for g in self.gens if self.blocks.get(id(g)) is None or self.blocks[id(g)]()]

    def advance(self, gen: Iterator[Blocked]) -> None:
        self.progress[self.number[id(gen)]] += 1
        try:
            self.blocks[id(gen)] = next(gen)
        except StopIteration:
            self.gens.remove(gen)
            self.blocks.pop(id(gen), None)
        self.check()

    def key(self) -> tuple:
        """Everything that decides what happens next: two orders of steps that reach the same key have the
        same futures."""
        parts: list = [tuple(self.progress), tuple(self.computed), tuple(self.entered), tuple(self.posted),
                       self.home.tobytes(),
                       self.writes.tobytes(),
                       tuple(str(e) for e in self.errors),
                       tuple((t, tuple(sorted(g))) for t, g in sorted(self.gathered.items()))]
        for w, state in enumerate(self.states):
            parts += [self.cache[w].tobytes(), self.cache_id[w].tobytes(), self.needed[w].tobytes(),
                      self.compute_slot_of[w].tobytes(), tuple(sorted(self.ready[w])),
                      tuple(v.tobytes() for v in self.unsent[w]), len(self.actions[w]),
                      state.t, state.written, state.plan_step is None, len(state.posted), state.waiting,
                      len(state.read_ahead), state.flush_wanted,
                      tuple((t, mask.tobytes(), at.tobytes()) for t, (mask, at) in sorted(state.early.items())),
                      state._free[:state._free_count].tobytes(),
                      None if state.in_flight is None else ("x", state.in_flight.t),
                      *(a.tobytes() for a in state.directory.cached()), state.directory.owner.tobytes(),
                      tuple(a.tobytes() for u in state.unsent for a in u), state.doing,
                      tuple((u, i.tobytes(), v.tobytes()) for u, i, v in getattr(state, "recent_writes", ()))]
        return tuple(parts)

    def check(self) -> None:
        """A checkpoint's view: with every worker idle and every trainer at the same iteration, the home
        overlaid with each cache where its state places rows is every row's current value. (One trainer:
        at any step; several: between iterations, where LrppRows.quiesce is called, since a row evicted
        and written home by another trainer is current only once that trainer has posted it.)"""
        if any(e is not None for e in self.errors) or len(set(self.computed)) != 1:
            return
        if self.size > 1 and self.posted != self.computed:
            return
        if not all(s.idle() for s in self.states):
            return
        truth = self.before[self.computed[0]]
        logical = self.home.copy()
        for w, state in enumerate(self.states):
            held, held_slots = state.directory.cached()
            assert state.held == len(held), f"trainer {w}: the count of cached rows"
            assert state.held - state.rows_fetched_ahead <= state.peak_held <= self.plan.num_slots, f"trainer {w}: peak"
            assert np.array_equal(self.cache[w][held_slots], truth[held]), f"trainer {w} holds a stale row"
            logical[held] = self.cache[w][held_slots]
        assert np.array_equal(logical, truth), "a checkpoint would save stale rows"

    def finished(self) -> None:
        """The end of a run: every eviction home exactly once, nothing cached, the home current."""
        if any(e is not None for e in self.errors):
            return
        assert all(isinstance(s.next_action(), Finished) for s in self.states)
        evictions = np.zeros(self.plan.total_rows, dtype=np.int64)
        for step in self.plan.steps[self.start:]:
            evictions[step.evict_ids] += 1
        assert np.array_equal(self.writes, evictions), "an eviction was not written home exactly once"
        assert np.array_equal(self.home, self.before[-1])
        assert all(not len(s.directory.cached_ids()) and (s.directory.owner < 0).all() and s.held == 0
                   for s in self.states)

    def run_random(self, rng: np.random.Generator, limit: int = 100_000) -> None:
        for _ in range(limit):
            ready = self.ready_gens()
            if not ready:
                assert not self.gens or any(e is not None for e in self.errors), "deadlock"
                self.finished()
                return
            self.advance(ready[int(rng.integers(0, len(ready)))])
        raise AssertionError("the run never ended")


def summary(action) -> tuple:
    """An action as comparable values."""
    if isinstance(action, Exchange):
        return ("exchange", action.t, action.write_ids.tolist(), action.write_slots.tolist(),
                action.fetch_ids.tolist(), action.fetch_slots.tolist(), action.ahead, action.sends_writes)
    if isinstance(action, SharedExchange):
        return ("shared exchange", action.t, action.write_ids.tolist(), action.write_slots.tolist(),
                action.fetch_ids.tolist(), action.fetch_slots.tolist(), action.fetcher.tolist(),
                action.prefetch_ids.tolist())
    if isinstance(action, CopyOut):
        return ("copy", action.done.t, action.ids.tolist(), action.slots.tolist())
    return (type(action).__name__, getattr(action, "t", None))


def every_interleaving(make: Callable[[], System], limit: int = 50_000) -> tuple[int, list[System]]:
    """Run ``make()``'s system along every order of its ready generators' steps: a search over the states
    reached (an order that reaches a state already seen has the same futures), every one checked, and at
    every step, that the state's k-th action is the same whatever the order. Returns the number of states
    and the systems at the ends (one per distinct end state)."""
    seen: set[tuple] = set()
    ends: list[System] = []
    canonical: list[list[tuple]] | None = None
    pending: list[list[int]] = [[]]  # the index among the ready generators of every step, from the start
    while pending:
        choices = pending.pop()
        system = make()
        for c in choices:
            system.advance(system.ready_gens()[c])
        while True:  # on along the first choice; the others are replayed from the start later
            key = system.key()
            if key in seen:
                break
            seen.add(key)
            assert len(seen) <= limit
            if canonical is None:
                canonical = [[] for _ in system.actions]
            for mine, agreed in zip(system.actions, canonical, strict=True):
                assert mine[: len(agreed)] == agreed[: len(mine)], "the state's actions depend on the timing"
                agreed += mine[len(agreed):]
            ready = system.ready_gens()
            if not ready:
                assert not system.gens or any(e is not None for e in system.errors), "deadlock"
                system.finished()
                ends.append(system)
                break
            pending += [[*choices, c] for c in range(1, len(ready))]
            system.advance(ready[0])
            choices = [*choices, 0]
    return len(seen), ends


# ---- the exhaustive scenarios ---------------------------------------------------------------------------
def reuse_scenario(distance: int, same_row: bool) -> Plan:
    """Row 0 is used at 0 in slot 0 and evicted; rows 1 are used at ``1 .. P``; at ``P + 1`` the freed slot 0
    takes row 0 again (``same_row``) or row 2 while row 0 comes back in slot 2: the earliest refetch and
    slot reuse the distance allows, in the same exchange as the write-back they must follow."""
    batches = [[0]] + [[1]] * distance + [[0, 2]]
    last = distance + 1
    slots = {(0, 0): 0, (1, 1): 1, (last, 0): 0 if same_row else 2, (last, 2): 3 if same_row else 0}
    return scripted_plan(batches, slots, distance)


@pytest.mark.parametrize("same_row", [True, False])
@pytest.mark.parametrize("distance", [1, 2])
def test_every_interleaving_of_a_prefetch_a_write_back_and_an_eviction(distance, same_row):
    plan = reuse_scenario(distance, same_row)
    states, ends = every_interleaving(lambda: System(plan))
    assert states > 50
    assert len(ends) == 1 and ends[0].errors == [None], "the end depends on the timing"
    exchanges = [a for a in ends[0].actions[0] if a[0] == "exchange"]
    # The refetch goes in the exchange for P + 1, right behind the write-back of iteration 0 (slot 0).
    assert exchanges[distance + 1][1:4] == (distance + 1, [0], [0])
    assert 0 in exchanges[distance + 1][4]
    # After the last iteration: one write-back per iteration not yet written (1 .. P + 1).
    assert [a[1] for a in exchanges] == [*range(distance + 2), *[None] * (distance + 1)]


@pytest.mark.parametrize("distance", [1, 2, 3])
def test_every_interleaving_with_write_backs_held_and_a_checkpoint(distance):
    """Rows 1 and 2 used at 0 (row 2 also at 1) and evicted; row 3, used at 2 .. P + 1, is prefetched for 1 (with
    P > 1 by the exchange for 0); iterations 2 .. P + 1 fetch nothing, so row 1's write-back waits; a checkpoint
    after 0 must find it home (a flush sends it); row 1 comes back at P + 2 into row 2's slot, in the exchange
    that writes row 2 home."""
    batches = [[1, 2], [2], *([[3]] * distance), [1]]
    slots = {(0, 1): 0, (0, 2): 1, (1, 3): 2, (distance + 2, 1): 1}
    plan = scripted_plan(batches, slots, distance)
    states, ends = every_interleaving(lambda: System(plan, checkpoints=frozenset({0}), spare_slots=1))
    assert states > 30
    # (The ends differ only in how often the worker was woken: by the flush request, or not at all.)
    assert len({repr(e.actions) for e in ends}) == 1 and all(e.errors == [None] for e in ends), \
        "the end depends on the timing"
    exchanges = [a for a in ends[0].actions[0] if a[0] == "exchange"]
    early = distance > 1
    assert exchanges[0][4:6] == (([1, 2, 3], [0, 1, 2]) if early else ([1, 2], [0, 1])), "row 3 of 1 with 0's"
    assert all(not x[7] for x in exchanges if x[1] in range(2 - early, distance + 2)), "nothing sent for 2 .. P + 1"
    assert [x[2] for x in exchanges if x[1] is None][0] == [1], "the flush sends row 1's write-back"
    assert [x[2:6] for x in exchanges if x[1] == distance + 2] == [([2], [1], [1], [1])]


@pytest.mark.parametrize("same_slot", [True, False])
@pytest.mark.parametrize("distance", [1, 2])
def test_a_refetch_one_iteration_too_early_fails_in_every_interleaving(distance, same_slot):
    """Row 0 evicted after 0 and fetched again for ``P``: its eviction is not taken yet when that fetch is
    issued, so every interleaving raises, the same error, and no row is read stale before it."""
    batches = [[0], *([[1]] * (distance - 1)), [0, 1]]
    slots = {(0, 0): 0, (1, 1): 1, (distance, 0): 0 if same_slot else 2}
    plan = scripted_plan(batches, slots, distance)
    plan.steps[0] = Step(0, plan.steps[0].prefetch_ids, plan.steps[0].prefetch_slots, ids(0))  # evicted after 0
    states, ends = every_interleaving(lambda: System(plan))
    assert states > 10 and len(ends) > 1  # compute got more or less far before the worker failed
    messages = {str(e.errors[0]) for e in ends}
    assert messages == {f"iteration {distance}: id 0 is prefetched while its previous copy is still cached or not "
                        "yet written back (a stale read)"}  # whatever slot the plan names
    assert {e.states[0].doing for e in ends} == {
        f"while writing back evictions and prefetching for iteration {distance}"}


def two_trainer_scenario(distance: int) -> Plan:
    """Two trainers: rows 0 and 1 used at 0 and evicted (row 0 written home by trainer 1, its only user;
    row 1 by trainer ``1 % 2``), rows 2 used at ``1 .. P``, and rows 0 and 1 fetched again at ``P + 1`` into
    each other's freed slots, in the exchange that writes them home."""
    batches = [[0, 1]] + [[2]] * distance + [[0, 1]]
    last = distance + 1
    slots = {(0, 0): 0, (0, 1): 1, (1, 2): 2, (last, 0): 1, (last, 1): 0}
    return scripted_plan(batches, slots, distance)


@pytest.mark.parametrize("gateway", [False, True])
def test_every_interleaving_of_two_trainers(gateway):
    """P = 1 (P = 2 has some 5,000 states, a minute: the random traces below cover W = 2, 3 and P = 1, 2)."""
    distance = 1
    plan = two_trainer_scenario(distance)
    writers = [np.zeros(len(s.evict_ids), np.int64) if gateway else
               np.where(s.evict_ids == 0, 1, s.evict_ids % 2).astype(np.int64) for s in plan.steps]
    states, ends = every_interleaving(lambda: System(plan, size=2, gateway=gateway, writers=writers))
    assert states > 1000
    assert len(ends) == 1 and ends[0].errors == [None, None], "the end depends on the timing"
    refetch = [a for a in ends[0].actions[0] if a[0] == "shared exchange" and a[1] == distance + 1][0]
    assert refetch[4] == [0, 1] and refetch[6] == ([0, 0] if gateway else [1, 1])  # their last writers fetch them


def test_a_fetch_by_another_trainer_than_the_last_writer_can_read_stale(monkeypatch):
    """The fetcher rule is what the W-trainer model relies on: with ``id % W`` always, some interleaving
    lets trainer 0 fetch row 0 before trainer 1 (its writer) has written it home."""
    plan = two_trainer_scenario(1)
    # Trainer 1 writes row 0 home in its exchange for iteration 2; with ``id % W`` trainer 0 fetches it in
    # its own exchange for 2, which nothing orders after trainer 1's (the collective comes after both).
    writers = [np.where(s.evict_ids == 0, 1, s.evict_ids % 2).astype(np.int64) for s in plan.steps]
    monkeypatch.setattr(PartitionedPrefetchState, "fetchers", lambda self, xs: xs % self.size)
    with pytest.raises(AssertionError, match="read a stale row"):
        every_interleaving(lambda: System(plan, size=2, writers=writers))


def test_a_write_is_remembered_exactly_as_long_as_it_may_be_on_its_way(monkeypatch):
    """The writers are remembered for the evictions of the last 2 (2P + 1) iterations, twice what the argument
    (module docstring of prefetch_state) needs. Needed: remembering only 2P, a fetch goes to a trainer whose
    exchange can overtake the writer's (the plan of seed 11, three trainers, P = 2: a stale read under some
    interleaving); 2P + 1 is enough for it, as for every test here (checked by hand at 2P + 1)."""
    rng = np.random.default_rng(7000 + 11)
    distance = int(rng.integers(1, 3))
    plan = random_plan(rng, int(rng.integers(4, 12)), int(rng.integers(3, 9)), distance + int(rng.integers(0, 3)),
                       distance)
    assert distance == 2
    real = PartitionedPrefetchState.__init__

    def remembering(cycles: int):
        def init(self, *args, **kwargs):
            real(self, *args, **kwargs)
            self.remembered = cycles
        return init

    def runs() -> None:
        for trial in range(3):
            system = System(plan, size=3, seed=11, holders=False)
            system.run_random(np.random.default_rng(trial))
            assert system.errors == [None] * 3

    monkeypatch.setattr(PartitionedPrefetchState, "__init__", remembering(2 * distance))
    with pytest.raises(AssertionError, match="read a stale row"):
        runs()
    monkeypatch.setattr(PartitionedPrefetchState, "__init__", remembering(2 * distance + 1))
    runs()


# ---- random plans, random interleavings -----------------------------------------------------------------
@pytest.mark.parametrize("seed", range(60))
def test_random_plans_under_random_interleavings(seed):
    rng = np.random.default_rng(seed)
    distance = int(rng.integers(1, 4))
    plan = random_plan(rng, int(rng.integers(4, 14)), int(rng.integers(3, 9)),
                       distance + int(rng.integers(0, 3)), distance)
    start = int(rng.integers(0, plan.iterations)) if seed % 3 == 0 else 0
    checkpoints = frozenset(rng.integers(start, plan.iterations, 2).tolist()) if seed % 2 else frozenset()
    spare = seed % 4  # cache slots for rows fetched early whose own slot is still taken
    reference = System(plan, start=start, checkpoints=checkpoints, spare_slots=spare)
    reference.run_random(np.random.default_rng(0))
    assert reference.errors == [None]
    for trial in range(4):
        system = System(plan, start=start, checkpoints=checkpoints, spare_slots=spare)
        system.run_random(np.random.default_rng(1000 * seed + trial))
        assert system.actions == reference.actions


@pytest.mark.parametrize("holders", [False, True])
@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("size", [2, 3])
def test_random_plans_on_several_trainers(size, seed, holders):
    rng = np.random.default_rng(7000 + seed)
    distance = int(rng.integers(1, 3))
    plan = random_plan(rng, int(rng.integers(4, 12)), int(rng.integers(3, 9)),
                       distance + int(rng.integers(0, 3)), distance)
    gateway = seed % 4 == 1
    start = int(rng.integers(0, plan.iterations)) if seed % 3 == 0 else 0
    actions = None
    for trial in range(3):
        system = System(plan, size=size, start=start, gateway=gateway, seed=seed, holders=holders)
        system.run_random(np.random.default_rng(trial))
        assert system.errors == [None] * size
        # The trainers agree on every exchange's prefetches and fetchers, split its writes, and each holds
        # the prefetched rows whose holders include it.
        per_trainer = [[a for a in acts if a[0] == "shared exchange"] for acts in system.actions]
        for same in zip(*per_trainer, strict=True):
            assert len({(a[1], tuple(a[6]), tuple(a[7])) for a in same}) == 1
            written = [x for a in same for x in a[2]]
            assert len(written) == len(set(written))
        if gateway:
            assert all(a[2] == [] and a[6] == [0] * len(a[7]) for a in per_trainer[1]), \
                "the gateway's trainer 0 writes and fetches every row"
            assert all(a[4] == a[7] for a in per_trainer[0]), "the gateway's trainer 0 holds every row"
        if actions is None:
            actions = system.actions
        assert system.actions == actions, "the state's actions depend on the timing"


@pytest.mark.parametrize("seed", range(40))
def test_random_plans_with_a_window_below_the_distance_fail_exactly_when_they_refetch_too_early(seed):
    rng = np.random.default_rng(500 + seed)
    distance = int(rng.integers(2, 4))
    plan = random_plan(rng, int(rng.integers(4, 14)), int(rng.integers(3, 7)), int(rng.integers(0, distance)),
                       distance)
    system = System(plan)
    system.run_random(rng)
    if refetched_too_early(plan):
        assert isinstance(system.errors[0], PlanViolation)
        assert "(a stale read)" in str(system.errors[0])
    else:
        assert system.errors == [None]


@pytest.mark.parametrize("seed", range(20))
def test_the_plans_slots_do_not_matter(seed):
    """A valid random plan with one prefetch moved into a slot whose row the worker has not taken yet: the worker
    places rows in slots of its own, so it runs exactly as the plan as made (the plan's slots only say where a
    restart finds the rows cached before it)."""
    rng = np.random.default_rng(900 + seed)
    distance = int(rng.integers(1, 3))
    plan = random_plan(rng, 10, 6, distance + 1, distance)
    owner: dict[int, int] = {}
    evicted: dict[int, list[int]] = {}
    candidates = []
    for step in plan.steps:
        for s in evicted.pop(step.t - distance - 1, []):
            owner.pop(s)
        busy = sorted(set(owner) - set(step.prefetch_slots.tolist()))
        if len(step.prefetch_ids) and busy:
            candidates.append((step.t, {slot: owner[slot] for slot in busy}))
        for x, s in zip(step.prefetch_ids.tolist(), step.prefetch_slots.tolist(), strict=True):
            owner[s] = x
        slot_of = {x: s for s, x in owner.items()}
        evicted[step.t] = [slot_of[x] for x in step.evict_ids.tolist()]
    if not candidates:
        pytest.skip("no slot is busy at a prefetch in this plan")
    t, busy = candidates[int(rng.integers(0, len(candidates)))]
    slot = sorted(busy)[int(rng.integers(0, len(busy)))]
    step = plan.steps[t]
    bad_slots = step.prefetch_slots.copy()
    bad_slots[0] = slot
    steps = list(plan.steps)
    steps[t] = Step(t, step.prefetch_ids, bad_slots, step.evict_ids)
    reference = System(plan, spare_slots=seed % 3)
    reference.run_random(np.random.default_rng(seed))
    system = System(plan, steps=steps, spare_slots=seed % 3)
    system.run_random(rng)
    assert system.errors == reference.errors == [None]
    assert system.actions == reference.actions


# ---- the events one at a time ---------------------------------------------------------------------------
def steps_of(*specs: tuple[list[int], list[int], list[int]]) -> list[Step]:
    return [Step(t, ids(*f), ids(*s), ids(*e)) for t, (f, s, e) in enumerate(specs)]


def test_the_actions_of_a_short_plan_in_order():
    """P = 1: two iterations prepared before any eviction is needed, then one eviction per exchange; after
    the last iteration, one write-back per posted eviction, then Finished. (With P = 1 no row is fetched
    early: the exchange for ``t + 1`` may go as soon as ``t - 1`` is computed.)"""
    steps = steps_of(([5, 6], [0, 1], [5]), ([7], [2], [6]), ([5], [0], [7, 5]))
    state = PrefetchState(3, 1, 3)
    assert state.next_action() == ReadPlan(0) and state.doing == "while preparing iteration 0"
    state.plan_read(steps[0])
    x0 = state.next_action()
    assert (x0.t, x0.write_ids.tolist(), x0.fetch_ids.tolist(), x0.fetch_slots.tolist()) == (0, [], [5, 6], [0, 1])
    assert x0.plan is steps[0] and isinstance(x0, Exchange)
    with pytest.raises(RuntimeError, match="still in flight"):
        state.next_action()
    state.exchanged(x0)
    assert state.directory.lookup([5, 6]).tolist() == [0, 1] and state.directory.owner.tolist() == [5, 6, -1]
    assert state.next_action() == ReadPlan(1)
    state.plan_read(steps[1])
    x1 = state.next_action()
    assert x1.t == 1 and not len(x1.write_ids)
    state.exchanged(x1)
    assert state.next_action() == ReadPlan(2)
    state.plan_read(steps[2])
    assert not state.idle()
    assert state.next_action() == WaitForDone(0) and state.waiting and state.idle()
    assert state.doing == "while preparing iteration 2"
    state.evictions_posted(Done(0, ids(5), ids(0), None))
    assert not state.idle()
    take = state.evictions_taken()
    assert (take.ids.tolist(), take.slots.tolist()) == ([5], [0])
    assert state.directory.lookup([5])[0] == -1 and state.directory.owner[0] == -1
    x2 = state.next_action()  # row 5 goes home and comes back into the slot it left, in one exchange
    assert (x2.t, x2.write_ids.tolist(), x2.write_slots.tolist(), x2.fetch_ids.tolist()) == (2, [5], [0], [5])
    assert state.doing == "while writing back evictions and prefetching for iteration 2"
    state.exchanged(x2)
    assert state.draining()
    assert state.next_action() == WaitForDone(1)
    state.evictions_posted(Done(1, ids(6), ids(1), None))
    state.evictions_posted(Done(2, ids(5, 7), ids(0, 2), None))
    state.evictions_taken()
    assert state.doing == "while writing back the evictions of iteration 1"
    x3 = state.next_action()
    assert (x3.t, x3.plan, x3.write_ids.tolist(), len(x3.fetch_ids)) == (None, None, [6], 0)
    state.exchanged(x3)
    assert state.next_action() == WaitForDone(2) and not state.idle()  # iteration 2's evictions are posted already
    state.evictions_taken()
    x4 = state.next_action()
    assert x4.write_ids.tolist() == [5, 7]
    state.exchanged(x4)
    assert state.next_action() == Finished() and not len(state.directory.cached_ids())


def stepper(state: PrefetchState, steps: list[Step]) -> Callable[[], object]:
    """``state.next_action()``, answering the plan reads from ``steps``."""
    def step():
        while isinstance(action := state.next_action(), ReadPlan):
            state.plan_read(steps[action.t])
        return action
    return step


def test_one_exchange_fetches_the_rows_of_the_next_p_iterations_it_can():
    """P = 3, two spare slots: the plan is read two iterations ahead, and an exchange that fetches rows of its own
    also fetches those of the next two iterations whose id is not cached: iterations 1, 2 and 3 send nothing,
    and 4 fetches row 5 (into the slot it left after 0, behind its write-back) and row 9."""
    steps = steps_of(([5, 6], [0, 1], [5]), ([7], [2], [6]), ([8], [3], []), ([], [], []),
                     ([5, 9], [0, 4], [5, 7, 8, 9]), ([], [], []))
    state = PrefetchState(6, 3, 5, spare_slots=2)
    step = stepper(state, steps)
    x0 = step()
    assert (x0.t, x0.fetch_ids.tolist(), x0.fetch_slots.tolist(), x0.ahead, x0.ready_ids.tolist()) == \
        (0, [5, 6, 7, 8], [0, 1, 2, 3], 2, [5, 6])
    state.exchanged(x0)
    assert state.rows_fetched_ahead == 2 and sorted(state.early) == [1, 2]
    for t, rows in ((1, [7]), (2, [8]), (3, [])):
        x = step()
        assert (x.t, len(x.fetch_ids), len(x.write_ids), x.sends_writes, x.ready_ids.tolist()) == (t, 0, 0, False, rows)
        state.exchanged(x)
    assert state.rows_fetched_ahead == 0
    assert step() == WaitForDone(0)
    state.evictions_posted(Done(0, ids(5), ids(0), None))
    state.evictions_taken()
    x4 = step()
    assert (x4.t, x4.write_ids.tolist(), x4.fetch_ids.tolist(), x4.fetch_slots.tolist(), x4.ready_ids.tolist()) == \
        (4, [5], [5, 9], [0, 4], [5, 9])
    state.exchanged(x4)
    assert state.directory.lookup([5, 6, 7, 8, 9]).tolist() == [0, 1, 2, 3, 4]


def test_rows_fetched_early_are_at_most_the_spare_slots():
    """P = 2, a plan of three slots and one spare: the exchange for 0 fetches one row of iteration 1 early (row 2,
    the budget), so 1 still fetches row 5; the one for 3 fetches row 4 of 4 into the fourth slot. So the rows the
    plan fetches on time always find a slot. The worker tells compute where each row is."""
    steps = steps_of(([1], [0], [1]), ([2, 5], [1, 2], [2, 5]), ([], [], []), ([3], [0], [3]), ([4], [1], [4]))
    state = PrefetchState(5, 2, 3, spare_slots=1)
    step = stepper(state, steps)
    x0 = step()
    assert (x0.fetch_ids.tolist(), x0.fetch_slots.tolist(), x0.ahead) == ([1, 2], [0, 1], 1)
    state.exchanged(x0)
    x1 = step()
    assert (x1.t, x1.fetch_ids.tolist(), x1.fetch_slots.tolist(), x1.ready_ids.tolist(), x1.ready_slots.tolist()) == \
        (1, [5], [2], [2, 5], [1, 2])
    state.exchanged(x1)
    x2 = step()
    assert (x2.t, x2.sends_writes) == (2, False)
    state.exchanged(x2)
    assert step() == WaitForDone(0)
    state.evictions_posted(Done(0, ids(1), ids(0), None))
    state.evictions_taken()
    x3 = step()
    assert (x3.write_ids.tolist(), x3.fetch_ids.tolist(), x3.fetch_slots.tolist(), x3.ahead, x3.ready_slots.tolist()) \
        == ([1], [3, 4], [0, 3], 1, [0])
    state.exchanged(x3)
    assert state.directory.owner.tolist() == [3, 2, 5, 4] and state.rows_fetched_ahead == 1
    assert step() == WaitForDone(1)
    state.evictions_posted(Done(1, ids(2, 5), ids(1, 2), None))
    state.evictions_taken()
    x4 = step()
    assert (x4.t, x4.sends_writes, x4.ready_ids.tolist(), x4.ready_slots.tolist()) == (4, False, [4], [3])
    state.exchanged(x4)
    drain = step()  # every iteration prepared: a held write-back goes at once
    assert (drain.t, drain.write_ids.tolist()) == (None, [2, 5])
    state.exchanged(drain)
    for t, (evict, slot) in enumerate(((EMPTY_IDS, EMPTY_IDS), (ids(3), ids(0)), (ids(4), ids(3))), start=2):
        assert step() == WaitForDone(t)
        state.evictions_posted(Done(t, evict, slot, None))
        state.evictions_taken()
        state.exchanged(step())
    assert step() == Finished() and state._free_count == 4 and state.peak_held == 3


def test_write_backs_wait_for_an_exchange_that_fetches_or_a_flush():
    """P = 1. Iterations 1 and 2 fetch nothing: no exchange is sent for them, and row 1's write-back (evicted
    after 0) waits; the worker is not idle while it holds it. A flush sends it alone, and the next exchange
    that fetches carries the write-backs taken since."""
    steps = steps_of(([1, 2], [0, 1], [1]), ([], [], [2]), ([], [], []), ([3], [1], [3]))
    state = PrefetchState(4, 1, 2)
    step = stepper(state, steps)

    def exchange(t: int) -> Exchange:
        action = step()
        assert isinstance(action, Exchange) and action.t == t, action
        state.exchanged(action)
        return action

    assert exchange(0).fetch_ids.tolist() == [1, 2]
    x1 = exchange(1)
    assert not x1.sends_writes and not len(x1.fetch_ids) and not len(x1.write_ids)
    assert step() == WaitForDone(0)
    state.evictions_posted(Done(0, ids(1), ids(0), None))
    state.evictions_taken()
    x2 = exchange(2)  # (P = 1: nothing is fetched early)
    assert not x2.sends_writes and not len(x2.write_ids) and [u[0].tolist() for u in state.unsent] == [[1]]
    assert step() == WaitForDone(1) and not state.idle()
    state.flush_requested()
    flush = state.next_action()
    assert (flush.t, flush.write_ids.tolist(), len(flush.fetch_ids), flush.sends_writes) == (None, [1], 0, True)
    assert state.doing == "while writing back held evictions"
    state.exchanged(flush)
    assert state.next_action() == WaitForDone(1) and state.idle() and not state.flush_wanted
    state.evictions_posted(Done(1, ids(2), ids(1), None))
    state.evictions_taken()
    x3 = state.next_action()
    assert (x3.t, x3.write_ids.tolist(), x3.fetch_ids.tolist()) == (3, [2], [3])
    state.exchanged(x3)
    state.flush_requested()  # with nothing held, a flush only clears the request
    assert state.next_action() == WaitForDone(2) and state.idle() and not state.flush_wanted


def test_evictions_are_taken_only_after_a_wait_and_exchanges_reported_once():
    state = PrefetchState(2, 1, 2)
    state.evictions_posted(Done(0, EMPTY_IDS, EMPTY_IDS, None))
    with pytest.raises(RuntimeError, match="without a WaitForDone"):
        state.evictions_taken()
    assert state.next_action() == ReadPlan(0)
    state.plan_read(Step(0, ids(1), ids(0), EMPTY_IDS))
    x = state.next_action()
    state.exchanged(x)
    with pytest.raises(RuntimeError, match="did not issue"):
        state.exchanged(x)


def test_a_resumed_state_starts_from_its_cached_rows():
    """``start = 3`` with rows 2 and 4 cached: the first eviction needed is 3's, at the exchange for 3 + P + 1."""
    state = PrefetchState(6, 2, 3, start=3, cached=(ids(2, 4), ids(1, 2)))
    assert state.directory.lookup(np.arange(6)).tolist() == [-1, -1, 1, -1, 2, -1]
    assert state.directory.owner.tolist() == [-1, 2, 4]
    read = []
    for _ in (3, 4, 5):
        while isinstance(action := state.next_action(), ReadPlan):
            read.append(action.t)
            state.plan_read(Step(action.t, EMPTY_IDS, EMPTY_IDS, EMPTY_IDS))
        state.exchanged(action)  # 3 + 2 + 1 = 6 >= iterations: no eviction is waited for
    assert read == [3, 4, 5]
    assert state.next_action() == WaitForDone(3)


def test_bad_plans_and_evictions_raise_plan_violations():
    def at(steps: list[Step], evict_slots=None, distance: int = 1, iterations: int = 2):
        """Run ``steps`` (empty ones after them, for a look ahead) until all are done."""
        state = PrefetchState(iterations, distance, 4)
        while state.t < len(steps):
            action = state.next_action()
            if isinstance(action, ReadPlan):
                state.plan_read(steps[action.t] if action.t < len(steps) else Step(action.t, EMPTY_IDS, EMPTY_IDS,
                                                                                    EMPTY_IDS))
            elif isinstance(action, WaitForDone):
                state.evictions_posted(Done(action.t, ids(1), ids(0) if evict_slots is None else evict_slots, None))
                state.evictions_taken()
            else:
                state.exchanged(action)
        return state

    with pytest.raises(PlanViolation, match="^the plan yielded iteration 1 where 0 was expected$"):
        at([Step(1, EMPTY_IDS, EMPTY_IDS, EMPTY_IDS)])
    with pytest.raises(PlanViolation, match=r"^iteration 0: 2 prefetch ids but 1 slots$"):
        at([Step(0, ids(1, 2), ids(0), EMPTY_IDS)])
    with pytest.raises(PlanViolation, match="^iteration 0: two prefetched rows share a cache slot$"):
        at([Step(0, ids(1, 2), ids(0, 0), EMPTY_IDS)])
    with pytest.raises(PlanViolation, match=r"^iteration 1: the worker holds more rows than its cache of 4 \(a plan "
                                            r"made for other batches\?\)$"):
        at([Step(0, ids(1, 2, 3), ids(0, 1, 2), EMPTY_IDS), Step(1, ids(4, 5), ids(3, 0), EMPTY_IDS)])
    with pytest.raises(PlanViolation, match=r"^iteration 1: id 1 is prefetched while its previous copy is still "
                                            r"cached or not yet written back \(a stale read\)$"):
        at([Step(0, ids(1), ids(0), ids(1)), Step(1, ids(1), ids(1), EMPTY_IDS)])
    with pytest.raises(PlanViolation, match="^iteration 0: evicted rows are not where the worker put them$"):
        at([Step(0, ids(1), ids(0), ids(1)), Step(1, EMPTY_IDS, EMPTY_IDS, EMPTY_IDS),
            Step(2, EMPTY_IDS, EMPTY_IDS, EMPTY_IDS)], evict_slots=ids(3), iterations=3)
    with pytest.raises(ValueError, match="prefetch distance must be >= 1, got 0"):
        PrefetchState(2, 0, 4)
    # The same exchange may reuse the slot and the id its write-back frees: the shards apply writes first.
    state = at([Step(0, ids(1), ids(0), ids(1)), Step(1, EMPTY_IDS, EMPTY_IDS, EMPTY_IDS),
                Step(2, ids(1, 2), ids(1, 0), EMPTY_IDS)], iterations=3)
    assert state.directory.lookup([1, 2]).tolist() == [0, 1]  # the worker's slots, the lowest free first


@pytest.mark.parametrize("size", [2, 3])
def test_who_fetches_and_who_writes(size):
    """A row's fetcher is the trainer that last wrote it home, else ``id % W``; a trainer writes the evicted
    rows ``Done.writers`` gives it and frees them all; ``gateway``: trainer 0 fetches everything."""
    states = [PartitionedPrefetchState(3, 1, 6, size=size, rank=r) for r in range(size)]
    rows = np.arange(12, dtype=np.int64)
    for state in states:
        assert state.fetchers(rows).tolist() == (rows % size).tolist()
        assert state.next_action() == ReadPlan(0)
        state.plan_read(Step(0, ids(0, 1, 2, 3), ids(0, 1, 2, 3), ids(0, 1, 2, 3)))
        x = state.next_action()
        assert x.fetcher.tolist() == [0, 1, 2 % size, 3 % size]
        assert x.fetched_here.tolist() == [i for i in range(4) if i % size == state.rank]
        state.exchanged(x)
        assert state.next_action() == ReadPlan(1)
        state.plan_read(Step(1, EMPTY_IDS, EMPTY_IDS, EMPTY_IDS))
        state.exchanged(state.next_action())
        assert state.next_action() == ReadPlan(2)
        state.plan_read(Step(2, ids(2, 3, 4), ids(0, 1, 4), EMPTY_IDS))
        assert state.next_action() == WaitForDone(0)
        writers = np.array([size - 1, 0, 1, 1], dtype=np.int64)  # row 0's only user: the last trainer
        state.evictions_posted(Done(0, ids(0, 1, 2, 3), ids(0, 1, 2, 3), None, writers))
        take = state.evictions_taken()
        mine = writers == state.rank
        assert take.ids.tolist() == ids(0, 1, 2, 3)[mine].tolist() and take.slots.tolist() == take.ids.tolist()
        assert (state.directory.lookup(np.arange(4)) < 0).all()
        x = state.next_action()
        assert x.write_ids.tolist() == take.ids.tolist()
        assert x.fetcher.tolist() == [1, 1, 4 % size]  # rows 2 and 3 go to trainer 1, who wrote them
        assert state.fetchers(ids(0, 5)).tolist() == [size - 1, 5 % size]
        # A write is remembered while it may be on its way: 2 (2P + 1) iterations after its eviction's; then
        # it is home, and the row goes back to id % W. Nothing per embedding row is kept.
        assert state.remembered == 6 and [u for u, _, _ in state.recent_writes] == [0]
        state.t = 6
        assert state.fetchers(ids(0, 2)).tolist() == [size - 1, 1]
        state.t = 7
        assert state.fetchers(ids(0, 2)).tolist() == [0, 2 % size] and not state.recent_writes
    gateway = PartitionedPrefetchState(2, 1, 6, size=size, rank=1, gateway=True)
    assert gateway.fetchers(rows).tolist() == [0] * 12
    gateway.next_action()
    gateway.plan_read(Step(0, ids(4, 5), ids(0, 1), EMPTY_IDS))
    x = gateway.next_action()
    assert x.fetcher.tolist() == [0, 0] and not len(x.fetched_here)


def test_the_state_module_is_pure():
    """No threads, locks, streams, Dask or torch in the state (NumPy only)."""
    import ast
    from pathlib import Path

    import dlrmflow.engine.training.prefetch_state as state_module
    import dlrmflow.engine.training.slot_directory as directory_module

    for module in (state_module, directory_module):  # the state and the one project module it uses
        tree = ast.parse(Path(module.__file__).read_text())
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        allowed = {"__future__", "collections", "dataclasses", "typing", "numpy", directory_module.__name__}
        assert imported <= allowed, (module.__name__, imported - allowed)


def test_the_drivers_keep_their_interface():
    from dlrmflow.engine.training import prefetch

    assert prefetch.PlanViolation is PlanViolation and prefetch.Done is Done and prefetch.EMPTY_IDS is EMPTY_IDS
    for name in ("start", "wait_ready", "post_done", "join", "wait_idle", "stop", "bytes_fetched_ahead",
                 "cached", "peak_held", "doing"):
        assert hasattr(prefetch.PrefetchWorker, name)
    assert prefetch.WAIT_POLL_SECONDS == 1.0 and issubclass(prefetch.PrefetchError, RuntimeError)


# ---- the drivers around the state: real threads, an in-memory home --------------------------------------
class FakeShards:
    """The shards as one table in memory: an exchange applies its writes, then its fetches."""

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows
        self.calls: list[tuple[list[int], list[int]]] = []
        self.lock = threading.Lock()

    def exchange(self, write_ids, write_rows, fetch_ids, out=None) -> None:
        with self.lock:
            self.calls.append((np.asarray(write_ids).tolist(), np.asarray(fetch_ids).tolist()))
            self.rows[write_ids] = write_rows
            out[:] = self.rows[fetch_ids]


class FakeGroup:
    """Trainer ``rank`` of a group whose point-to-point messages are queues between threads."""

    def __init__(self, rank: int, size: int, hub: dict) -> None:
        self.rank, self.size, self.hub = rank, size, hub

    def send_rows(self, sends, counts, width, kind, *, prefetch=False, tag=0):
        assert kind == "prefetched rows" and prefetch
        for peer, rows in sends.items():
            if rows.shape[0]:
                self.hub[self.rank, peer].put(rows.clone())
        hub, rank = self.hub, self.rank

        class Pending:
            def wait(self):
                return {u: hub[u, rank].get(timeout=60) for u, n in counts.items() if n}

        return Pending()


def fake_hub(size: int) -> dict:
    return {(a, b): queue.Queue() for a in range(size) for b in range(size) if a != b}


def expected_exchanges(plan: Plan, start: int, make_state=None, steps=None, writers=None, checkpoints=(),
                       spare_slots: int = 0) -> list[tuple[list[int], list[int]]]:
    """The round trips a driver must make: the state's non-empty exchanges, compute posting each
    iteration's evictions (those the state holds) only when the state waits for them (the order does not
    matter: checked above), and a flush requested when it first waits after a checkpoint's iteration."""
    state = make_state() if make_state else PrefetchState(plan.iterations, plan.distance, plan.num_slots,
                                                          start=start,
                                                          cached=plan.cached_at(start), spare_slots=spare_slots)
    steps = plan.steps if steps is None else steps
    calls = []
    flushed = set()
    while not isinstance(action := state.next_action(), Finished):
        if isinstance(action, ReadPlan):
            state.plan_read(steps[action.t])
        elif isinstance(action, WaitForDone) and action.t - 1 in set(checkpoints) - flushed:
            flushed.add(action.t - 1)
            state.flush_requested()
        elif isinstance(action, WaitForDone):
            step = plan.steps[action.t]
            held = step.evict_ids[state.directory.lookup(step.evict_ids) >= 0]
            done = Done(action.t, held, state.directory.lookup(held), None)
            if isinstance(state, PartitionedPrefetchState):
                done.writers = step.evict_ids % state.size if writers is None else writers[action.t]
                done.evicted = step.evict_ids
            state.evictions_posted(done)
            state.evictions_taken()
        else:
            here = action.fetched_here if isinstance(action, SharedExchange) else action.fetch_ids
            if len(here) or len(action.write_ids):
                calls.append((action.write_ids.tolist(), here.tolist()))
            state.exchanged(action)
    return calls


def run_compute(worker, plan: Plan, cache, start: int, before: np.ndarray, device: torch.device,
                writers=None, checkpoints=(), holder_at=None, rank: int = 0,
                collective: threading.Barrier | None = None) -> None:
    """What the oracle store does each iteration: wait for the rows, read them (every one current), update
    them in the cache, post the evictions; at ``checkpoints``, wait until the worker is idle and read the
    rows as ``logical_rows`` does. ``holder_at`` (several trainers): trainer ``rank`` reads and evicts only
    the rows it holds; ``collective``: the trainers' dense-gradient collective of every iteration, which each
    joins once it has the iteration's rows and before it posts its evictions."""
    slot_of = np.full(plan.total_rows, -1, dtype=np.int64)
    cached, slots = plan.cached_at(start)
    slot_of[cached] = slots
    for u in range(start, plan.iterations):
        ready = worker.wait_ready(u)
        assert ready.plan.t == u
        slot_of[ready.ids] = ready.slots
        if ready.event is not None:
            torch.cuda.current_stream(device).wait_event(ready.event)
        batch = plan.batches[u]
        evict = plan.steps[u].evict_ids
        if holder_at is not None:
            batch = batch[(holder_at[u][batch] >> rank & 1) == 1]
            evict = evict[(holder_at[u][evict] >> rank & 1) == 1]
        index = torch.from_numpy(slot_of[batch]).to(device)
        block = cache.index_select(0, index)
        assert (block.cpu().numpy() == before[u][batch][:, None]).all(), f"iteration {u} read a stale row"
        cache.index_copy_(0, index, block + 1)
        if collective is not None:
            collective.wait(60)
        evict_slots = slot_of[evict]
        slot_of[evict] = -1
        event = None
        if device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
        worker.post_done(Done(u, evict, evict_slots, event, None if writers is None else writers[u],
                              None if writers is None else plan.steps[u].evict_ids))
        if u in checkpoints:
            worker.wait_idle()
            logical = worker.home.rows[:, 0].copy()
            held, held_slots = worker.cached()
            logical[held] = cache.index_select(0, torch.from_numpy(held_slots).to(device)).cpu()[:, 0]
            assert np.array_equal(logical, before[u + 1]), f"a checkpoint after {u} would save stale rows"


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(6))
def test_the_driver_runs_random_plans_exactly(device, seed):
    """``PrefetchWorker`` on its thread (on a GPU: its side stream and events) against an in-memory home:
    every read current, every checkpoint's rows current, the home exact at the end, and its round trips
    exactly the state's exchanges."""
    rng = np.random.default_rng(4000 + seed)
    distance = int(rng.integers(1, 4))
    plan = random_plan(rng, int(rng.integers(6, 20)), int(rng.integers(4, 12)), distance + int(rng.integers(0, 3)),
                       distance)
    start = int(rng.integers(0, plan.iterations // 2)) if seed % 2 else 0
    width = 64 if device == "cuda" else 3
    before = plan.uses_before().astype(np.float32)
    shards = FakeShards(np.repeat(before[start][:, None], width, axis=1))
    dev = torch.device(device)
    spare = seed % 3
    cache = torch.zeros((plan.num_slots + spare, width), dtype=torch.float32, device=dev)
    cached, slots = plan.cached_at(start)
    cache[torch.from_numpy(slots).to(dev)] = torch.from_numpy(shards.rows[cached]).to(dev)
    worker = PrefetchWorker(iter(plan.steps[start:]), plan.iterations, distance, cache, shards,
                            start=start, cached=(cached, slots), spare_slots=spare)
    checkpoints = set(range(start, plan.iterations - 1))  # seeds 4000 and 4002 flush held write-backs
    worker.start()
    try:
        run_compute(worker, plan, cache, start, before, dev, checkpoints=checkpoints)
        worker.join()
    finally:
        worker.stop()
    assert (shards.rows == before[-1][:, None]).all()
    assert shards.calls == expected_exchanges(plan, start, checkpoints=checkpoints, spare_slots=spare)
    assert sum(len(fetched) for _, fetched in shards.calls) == sum(len(s.prefetch_ids) for s in plan.steps[start:])
    assert sum(len(written) for written, _ in shards.calls) == sum(len(s.evict_ids) for s in plan.steps[start:])


@pytest.mark.parametrize("holders", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_the_partitioned_driver_runs_random_plans_exactly(seed, holders):
    """Three ``PartitionedPrefetchWorker`` threads (and three compute threads) sharing one home: each
    writes its share, fetches its share and hands each row to its holders (every trainer, or random ones)."""
    rng = np.random.default_rng(5000 + seed)
    distance, size = int(rng.integers(1, 3)), 3
    plan = random_plan(rng, int(rng.integers(6, 16)), int(rng.integers(4, 12)), distance + 1, distance)
    before = plan.uses_before().astype(np.float32)
    rows = np.repeat(before[0][:, None], 2, axis=1)
    lock = threading.Lock()
    steps, holder_at, writers = random_holders(plan, size, rng, every=not holders)
    hub = fake_hub(size)
    collective = threading.Barrier(size)
    workers, caches, failures = [], [], []
    for rank in range(size):
        cache = torch.zeros((plan.num_slots, 2), dtype=torch.float32)
        caches.append(cache)
        shards = FakeShards(rows)  # one home; each trainer's round trips recorded apart
        shards.lock = lock
        workers.append(PartitionedPrefetchWorker(iter(steps), plan.iterations, distance, cache, shards,
                                                 group=FakeGroup(rank, size, hub)))

    def trainer(rank: int) -> None:
        try:
            run_compute(workers[rank], plan, caches[rank], 0, before, torch.device("cpu"), writers=writers,
                        holder_at=holder_at, rank=rank, collective=collective)
            workers[rank].join()
        except BaseException as exc:  # noqa: BLE001 - reported below
            collective.abort()  # the others' collective fails too, as a real one would
            failures.append(exc)

    threads = [threading.Thread(target=trainer, args=(r,)) for r in range(size)]
    for w in workers:
        w.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for w in workers:
        w.stop()
    assert not failures, failures
    assert (rows == before[-1][:, None]).all()
    for rank, w in enumerate(workers):  # the writers of a window of iterations, not of every row
        assert len(w.state.recent_writes) <= w.state.remembered + 1
        assert w.home.calls == expected_exchanges(plan, 0, lambda rank=rank: PartitionedPrefetchState(
            plan.iterations, distance, plan.num_slots, size=size, rank=rank), steps, writers)
