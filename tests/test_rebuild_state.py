"""The rebuild state machine without a cluster: events in, state and actions out.

A pure-NumPy model of the members (data shards, parity shards with pending deltas, replacements
with fresh rows and a rebuild id) and of the rebuild thread and its copy tasks, as generators that
take one atomic step at a time, drives :class:`RebuildState` through the same transitions as
``engine/coding/rebuild.py``. The tests enumerate every position of write-back batches among
those steps (before the log opens, between a copy's survivor reads, between a copy and its fix-up,
after a fix-up, ...), further losses mid-rebuild, and random traces; after every step, every stripe
the state declares rebuilt must hold, on every replacement, exactly what the lost member would hold.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from dlrmflow.engine.coding.erasure import ErasureCode, TooManyErasuresError, xor_bits
from dlrmflow.engine.coding.rebuild_state import FixUp, RebuildState, StartRebuild

Blocked = Callable[[], bool] | None  # what a step yields: None (done a step) or "run me again once this is true"


class Replica:
    """A replacement member: every row fresh (its initial row) until written or installed."""

    def __init__(self, initial: np.ndarray) -> None:
        self.initial = initial
        self.rows = np.zeros_like(initial)
        self.fresh = np.ones(len(initial), dtype=bool)
        self.rebuild = ""

    def reset(self, rebuild: str) -> None:
        self.fresh[:] = True
        self.rebuild = rebuild

    def materialise(self, stripes: np.ndarray) -> None:
        stripes = stripes[self.fresh[stripes]]
        self.rows[stripes] = self.initial[stripes]
        self.fresh[stripes] = False

    def current(self) -> np.ndarray:
        self.materialise(np.arange(len(self.rows)))
        return self.rows

    def write(self, stripes: np.ndarray, rows: np.ndarray) -> None:
        self.rows[stripes] = rows
        self.fresh[stripes] = False

    def apply_delta(self, stripes: np.ndarray, delta: np.ndarray) -> None:
        self.materialise(stripes)
        self.rows[stripes] = xor_bits(self.rows[stripes], delta)

    def install(self, stripes: np.ndarray, rows: np.ndarray, rebuild: str) -> None:
        if rebuild == self.rebuild:  # another rebuild's install changes nothing
            self.write(stripes, rows)


class System:
    """K data + R parity members, the trainer's write path and the rebuild, all in this process."""

    def __init__(self, k: int, r: int, n_stripes: int, *, chunk: int, fix_up_every_chunk: bool, seed: int) -> None:
        self.k, self.r, self.n = k, r, n_stripes
        self.code = ErasureCode(k, r)
        self.rng = np.random.default_rng(seed)
        self.initial = [self.rng.standard_normal((n_stripes, 2)).astype(np.float32) for _ in range(k)]
        self.initial += self.code.encode(self.initial)
        self.data = [rows.copy() for rows in self.initial[:k]]  # what each data shard holds (lost ones too)
        # What each parity shard holds with the deltas delivered so far (also for lost ones: the truth).
        self.parity = [rows.copy() for rows in self.initial[k:]]
        self.pending: list[tuple[np.ndarray, list[np.ndarray]]] = []  # (stripes, delta per parity shard)
        self.written = np.zeros((n_stripes, k), dtype=bool)
        self.state = RebuildState(self.code, n_stripes, list(range(k + r)), [None] * (k + r),
                                  [f"w{s}" for s in range(k + r)])
        self.replicas: dict[Replica, int] = {}
        self.chunk, self.fix_up_every_chunk = chunk, fix_up_every_chunk
        self.tasks: list[Iterator[Blocked]] = []  # copy tasks, in the background (never stopped)
        self.thread: Iterator[Blocked] | None = None
        self.ids = itertools.count(1)
        self.finished = 0  # rebuilds finished

    # ---- what each member holds ---------------------------------------------------------------
    def truth(self, s: int) -> np.ndarray:
        return self.data[s] if s < self.k else self.parity[s - self.k]

    def held(self, s: int, stripes: np.ndarray) -> np.ndarray:
        """A live member's rows (a surviving data shard holds every batch; a parity shard the deltas
        delivered to it)."""
        target = self.state.target(s)
        assert target is not None and s not in self.state.lost, s
        return self.truth(s)[stripes].copy()

    # ---- the trainer's side -------------------------------------------------------------------
    def write(self, n_rows: int = 3) -> None:
        """A write-back batch of random rows, as CodedShardGroup.exchange routes it."""
        state, k = self.state, self.k
        ids = np.unique(self.rng.integers(0, self.n * k, size=n_rows))
        stripes, shards = ids // k, ids % k
        new = self.rng.standard_normal((len(ids), 2)).astype(np.float32)
        state.write_logged(stripes)
        old_data = [d.copy() for d in self.data]
        for i in range(k):
            mask = shards == i
            self.data[i][stripes[mask]] = new[mask]
            self.written[stripes[mask], i] = True
            if i in state.lost and state.target(i) is not None:  # only rebuilt stripes reach a replacement
                through = mask & state.is_rebuilt(stripes)
                self.replica(state.target(i)).write(stripes[through], new[through])
        touched = np.unique(stripes)
        change = self.code.encode([xor_bits(old[touched], d[touched]) for old, d in zip(old_data, self.data,
                                                                                         strict=True)])
        self.pending.append((touched, change))

    def deliver(self) -> None:
        """The pending parity deltas reach every parity shard that has a target (as on settle)."""
        for stripes, change in self.pending:
            for p in range(self.r):
                self.parity[p][stripes] = xor_bits(self.parity[p][stripes], change[p])  # the truth
                target = self.state.target(self.k + p)
                if self.k + p in self.state.lost and target is not None:
                    self.replica(target).apply_delta(stripes, change[p])
        self.pending = []

    def lose(self, members: set[int]) -> None:
        action = self.state.member_lost(members, RuntimeError("killed"), 0.0)
        if isinstance(action, StartRebuild):
            assert self.thread is None
            self.thread = self.rebuild_thread()

    def replica(self, handle: Replica) -> Replica:
        assert handle in self.replicas
        return handle

    # ---- the rebuild thread and its copy tasks (rebuild.py's steps) ---------------------------
    def rebuild_thread(self) -> Iterator[Blocked]:
        state = self.state
        while True:
            begun = state.rebuild_begun()
            if begun is None:
                self.thread = None
                return
            lost, generation, need = begun
            yield None  # placing replacements (no lock)
            for s in need:
                replica = Replica(self.initial[s])
                self.replicas[replica] = s
                state.replacement_placed(s, f"spare{next(self.ids)}", None, replica)
            if state.generation != generation:
                continue
            yield None
            if state.generation != generation:
                continue
            # Steps 0 and 1, one lock hold: settle, reset the replacements, open the log.
            self.deliver()
            rebuild_id = f"{generation}-{next(self.ids)}"
            for s in lost:
                self.replica(state.replacement[s]).reset(rebuild_id)
            to_copy = self.stripes_to_copy(lost)
            assert state.log_opened(generation, to_copy)
            self.check()
            chunks = [to_copy[a : a + self.chunk] for a in range(0, len(to_copy), self.chunk)]
            survivors = state.survivors(lost)
            replicas = {s: self.replica(state.replacement[s]) for s in lost}
            done = [False] * len(chunks)
            for n, chunk in enumerate(chunks):
                self.tasks.append(self.copy_task(chunk, survivors, replicas, rebuild_id, done, n))
            complete = True
            for n, chunk in enumerate(chunks):
                yield lambda n=n, g=generation, done=done: done[n] or state.generation != g
                if state.generation != generation:
                    complete = False
                    break
                if self.fix_up_every_chunk is False and n + 1 < len(chunks):
                    assert state.chunk_copied(generation, chunk)
                    yield None
                    continue
                # Step 3, one lock hold.
                assert state.chunk_copied(generation, chunk)
                fix = state.fix_up_begun(generation)
                assert isinstance(fix, FixUp)
                if len(fix.stripes):
                    self.deliver()  # the pending deltas go out with the re-read and land first
                    pieces = {s: self.held(s, fix.stripes) for s in survivors}
                    decoded = self.code.decode(pieces, lost)
                    for s in lost:
                        replicas[s].install(fix.stripes, decoded[s], rebuild_id)
                assert state.fixed_up(fix)
                self.check()
                yield None
            state.log_closed()
            if not complete or state.generation != generation:  # a loss since the last fix-up: start over
                assert not state.rebuild_finished(generation, 1.0)
                continue
            for s in lost:  # a finished rebuild: every stripe exact
                assert np.array_equal(replicas[s].current().view(np.uint32), self.truth(s).view(np.uint32)), s
            assert state.rebuild_finished(generation, 1.0)
            self.finished += 1

    def copy_task(self, chunk: np.ndarray, survivors: tuple[int, ...], replicas: dict[int, Replica],
                  rebuild_id: str, done: list[bool], n: int) -> Iterator[Blocked]:
        """Reads the chunk from each survivor in turn (batches may land in between), decodes, installs."""
        if n:
            yield lambda: done[n - 1]  # the tasks run in chunk order
        pieces = {}
        for s in survivors:
            if s in self.state.lost:  # its worker died: the task fails; the rebuild has started over
                done[n] = True
                return
            pieces[s] = self.held(s, chunk)
            yield None
        decoded = self.code.decode(pieces, sorted(replicas))
        for s, replica in replicas.items():
            replica.install(chunk, decoded[s], rebuild_id)
        done[n] = True

    def stripes_to_copy(self, lost: list[int]) -> np.ndarray:
        columns = range(self.k) if any(s >= self.k for s in lost) else lost
        return np.flatnonzero(self.written[:, list(columns)].any(axis=1))

    # ---- the invariant --------------------------------------------------------------------------
    def check(self) -> None:
        """Every stripe declared rebuilt holds, on every replacement, what its lost member would hold."""
        state = self.state
        if state.rebuilt is None:
            return
        rebuilt = np.flatnonzero(state.rebuilt)
        for s in state.lost:
            if s not in state.replacement:
                continue
            got = self.replica(state.replacement[s]).current()[rebuilt]
            expected = self.truth(s)[rebuilt]
            # (a parity replacement holds the deltas delivered so far, as every parity shard does)
            assert np.array_equal(got.view(np.uint32), expected.view(np.uint32)), (s, rebuilt)

    def busy(self) -> bool:
        return self.thread is not None or bool(self.tasks)


class Driver:
    """Runs a System one step at a time: a fixed order (``step_system``) or chosen by ``choose``."""

    def __init__(self, system: System) -> None:
        self.system = system
        self.blocks: dict[int, Blocked] = {}

    def ready(self) -> list[Iterator[Blocked]]:
        s = self.system
        gens = [*s.tasks, *([s.thread] if s.thread is not None else [])]
        return [g for g in gens if self.blocks.get(id(g)) is None or self.blocks[id(g)]()]

    def advance(self, gen: Iterator[Blocked]) -> None:
        s = self.system
        try:
            self.blocks[id(gen)] = next(gen)
        except StopIteration:
            self.blocks.pop(id(gen), None)
            if gen in s.tasks:
                s.tasks.remove(gen)
        s.check()

    def step_system(self) -> bool:
        """One step of the first ready generator (copy tasks first); False when nothing is left to run."""
        ready = self.ready()
        if not ready:
            assert not self.system.busy(), "deadlock: every generator is blocked"
            return False
        self.advance(ready[0])
        return True

    def run_out(self, limit: int = 10_000) -> None:
        for _ in range(limit):
            if not self.step_system():
                return
        raise AssertionError("the rebuild never ended")


def _prepared(k: int, r: int, *, seed: int, fix_up_every_chunk: bool = True, n_stripes: int = 8,
              chunk: int = 2) -> System:
    """A system whose members were written before the loss (so some stripes are copied, others generated)."""
    system = System(k, r, n_stripes, chunk=chunk, fix_up_every_chunk=fix_up_every_chunk, seed=seed)
    for _ in range(3):
        system.write(4)
    system.deliver()
    return system


def _count_steps(k: int, r: int, lost: set[int], **kw) -> int:
    system = _prepared(k, r, **kw)
    driver = Driver(system)
    system.lose(lost)
    steps = 0
    while driver.step_system():
        steps += 1
    assert system.finished == 1 and not system.state.lost
    return steps


@pytest.mark.parametrize("fix_up_every_chunk", [True, False])
@pytest.mark.parametrize("lost", [{0}, {1}, {2}])
def test_one_write_batch_at_every_point_of_a_rebuild(lost, fix_up_every_chunk):
    """K = 2, R = 1: a write-back batch (and, or not, the delivery of its parity delta) before the log
    opens, between a copy's survivor reads, between the install and the fix-up, after a fix-up, ..."""
    kw = dict(seed=sorted(lost)[0], fix_up_every_chunk=fix_up_every_chunk)
    steps = _count_steps(2, 1, lost, **kw)
    assert steps > 8
    for at, deliver in itertools.product(range(steps + 1), (False, True)):
        system = _prepared(2, 1, **kw)
        driver = Driver(system)
        system.lose(lost)
        for _ in range(at):
            driver.step_system()
        system.write(6)
        if deliver:
            system.deliver()
        system.check()
        driver.run_out()
        assert system.finished == 1 and not system.state.lost


@pytest.mark.parametrize("lost", [{0}, {2}, {0, 1}, {1, 3}])
def test_two_write_batches_at_every_pair_of_points(lost):
    """K = 2, R = 2, one or two members lost: two batches at every pair of positions."""
    kw = dict(seed=7, fix_up_every_chunk=True)
    steps = _count_steps(2, 2, lost, **kw)
    for first, second in itertools.combinations_with_replacement(range(steps + 1), 2):
        system = _prepared(2, 2, **kw)
        driver = Driver(system)
        system.lose(lost)
        for at in range(steps + 1):
            for _ in range((at == first) + (at == second)):
                system.write(5)
            if at == second:
                system.deliver()
            if not driver.step_system():
                break
        driver.run_out()
        assert system.finished == 1 and not system.state.lost


@pytest.mark.parametrize("second", [0, 1, 2, 3])
def test_a_further_loss_at_every_point_starts_over_and_ignores_the_stale_installs(second):
    """K = 2, R = 2: data shard 0 is lost, then another member at every step of its rebuild, with a
    batch right after: the generation moves on, the old rebuild's copy tasks (still running) install
    nothing, and the rebuild of both ends exact. ``second`` 0: the replacement being rebuilt dies."""
    kw = dict(seed=11, fix_up_every_chunk=True)
    steps = _count_steps(2, 2, {0}, **kw)
    for at in range(steps + 1):
        system = _prepared(2, 2, **kw)
        driver = Driver(system)
        system.lose({0})
        for _ in range(at):
            driver.step_system()
        generation = system.state.generation
        system.lose({second})
        assert system.state.generation == generation + 1
        assert system.state.rebuilt is None and system.state.dirty is None
        system.write(5)
        driver.run_out()
        assert not system.state.lost
        if at < steps:  # the same recovery, started over
            assert system.finished == 1 and system.state.current_record().restarts == 1
        else:  # after the first rebuild finished: a recovery of its own
            assert system.finished == 2 and system.state.current_record().restarts == 0


def test_stale_transitions_change_nothing():
    state = RebuildState(ErasureCode(2, 2), 4, [0, 1, 2, 3], [None] * 4, ["a", "b", "c", "d"])
    assert isinstance(state.member_lost({0}, None, 0.0), StartRebuild)
    lost, generation, need = state.rebuild_begun()
    assert (lost, need) == ([0], [0])
    assert state.replacement_placed(0, "e", "future", "actor")
    assert not state.replacement_placed(0, "f", "future2", "actor2")  # one replacement per member
    assert state.busy_workers() == ["b", "c", "d", "e"]
    assert state.log_opened(generation, np.array([1, 2]))
    assert state.is_rebuilt(np.arange(4)).tolist() == [False] * 4
    state.write_logged(np.array([3]))
    assert state.chunk_copied(generation, np.array([1, 2]))
    assert state.member_lost({1}, RuntimeError("again"), 0.0) is None  # the rebuild thread is still running
    assert not state.chunk_copied(generation, np.array([1, 2]))
    assert state.fix_up_begun(generation) is None
    assert not state.fixed_up(FixUp(generation, np.zeros(0, np.int64), np.ones(4, bool), 2))
    assert not state.log_opened(generation, np.array([1]))
    assert not state.rebuild_finished(generation, 1.0)
    assert state.rebuilt is None and state.lost == {0, 1} and state.target(0) == "actor"
    record = state.current_record()
    assert record.restarts == 1 and record.members == [0, 1] and record.causes == ["again"]
    with pytest.raises(TooManyErasuresError):
        state.member_lost({3}, None, 0.0)
    assert isinstance(state.fatal, TooManyErasuresError)
    with pytest.raises(TooManyErasuresError):
        state.rebuild_begun()


def test_the_first_fix_up_adds_the_generated_stripes_and_a_logged_one_is_re_read():
    state = RebuildState(ErasureCode(2, 1), 6, [0, 1, 2], [None] * 3, ["a", "b", "c"])
    state.member_lost({1}, None, 0.0)
    _, generation, _ = state.rebuild_begun()
    state.replacement_placed(1, "d", None, "actor")
    state.log_opened(generation, np.array([0, 1, 2, 3]))  # 4 and 5 generated
    assert state.current_record().stripes_generated == 2
    state.write_logged(np.array([5, 0]))
    state.chunk_copied(generation, np.array([0, 1]))
    fix = state.fix_up_begun(generation)
    assert fix.stripes.tolist() == [0, 5] and fix.copied == 2
    assert np.flatnonzero(fix.joining).tolist() == [0, 1, 4, 5]
    state.fixed_up(fix)
    state.write_logged(np.array([2]))
    state.chunk_copied(generation, np.array([2, 3]))
    fix = state.fix_up_begun(generation)
    assert fix.stripes.tolist() == [2]  # 0 and 5 stay in the log, but are rebuilt already
    state.fixed_up(fix)
    assert state.rebuilt.all()
    state.log_closed()
    assert state.rebuild_finished(generation, 2.0)
    assert state.members == [0, "actor", 2] and state.worker_of == ["a", "d", "c"] and not state.lost
    assert state.rebuild_begun() is None and not state.recovering


def test_a_standby_is_taken_once_and_not_on_a_dead_or_busy_worker():
    state = RebuildState(ErasureCode(2, 2), 4, [0, 1, 2, 3], [None] * 4, ["a", "b", "c", "d"])
    state.standbys_set({0: ("s", "f0", "x0"), 1: ("s", "f1", "x1"), 2: ("b", "f2", "x2")})
    state.member_lost({0, 2}, None, 0.0)
    assert state.take_standby(0) == ("s", "f0", "x0")
    assert state.take_standby(0) is None  # once
    assert state.take_standby(2) is None  # on worker b, which hosts a live member
    state.replacement_placed(0, "s", "f0", "x0")
    assert state.take_standby(1) is None  # "s" now hosts a replacement
    state.worker_died("z")
    assert "z" in state.dead_workers and state.standby == {}


@pytest.mark.parametrize("seed", range(40))
def test_random_traces_end_exact(seed):
    """Random interleavings of writes, parity deliveries, rebuild and copy-task steps and further losses
    (K = 3, R = 2), chunks of 1-3 stripes, fix-ups after every chunk or once for all."""
    rng = np.random.default_rng(1000 + seed)
    system = _prepared(3, 2, seed=seed, fix_up_every_chunk=bool(rng.integers(0, 2)), n_stripes=7,
                       chunk=int(rng.integers(1, 4)))
    driver = Driver(system)
    system.lose({int(rng.integers(0, 5))})
    losses = 0
    for _ in range(400):
        roll = rng.random()
        if roll < 0.25:
            system.write(int(rng.integers(1, 6)))
        elif roll < 0.35:
            system.deliver()
        elif roll < 0.37 and losses < 2 and len(system.state.lost) < 2:
            losses += 1
            system.lose({int(rng.choice([s for s in range(5) if s not in system.state.lost]))})
        else:
            ready = driver.ready()
            if ready:
                driver.advance(ready[int(rng.integers(0, len(ready)))])
            elif not system.busy():
                break
    driver.run_out()
    assert not system.state.lost and system.finished >= 1
