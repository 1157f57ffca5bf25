"""The rebuild state machine without a cluster: events in, state and actions out.

A pure-NumPy model of the members (data shards, parity shards with pending deltas, replacements
with fresh rows and a rebuild id) and of the rebuild thread and its copy tasks, as generators that
take one atomic step at a time, carries out :class:`RebuildState`'s instructions as
``engine/coding/rebuild.py``'s driver does. The tests enumerate every position of write-back batches
among those steps (before the log opens, between a copy's survivor reads, between a copy and its
fix-up, after a fix-up, ...), further losses mid-rebuild, and random traces; after every step, every
stripe the state declares rebuilt must hold, on every replacement, exactly what the lost member would
hold.

A scripted driver with no data draws every outcome at random (further losses between lock holds,
placements and waits superseded, resets, copy tasks and fix-ups that find members lost, copy tasks that
fail with every member alive): the state never rebuilds more than R members, starts over only after a
new loss, and always ends, rebuilt or with the error that made it give up.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from dlrmflow.engine.coding.erasure import ErasureCode, TooManyErasuresError, xor_bits
from dlrmflow.engine.coding.rebuild_state import (
    AwaitChunk,
    ChunkCopied,
    CopyChunks,
    EndCopy,
    FindDead,
    FinishRebuild,
    FixUp,
    GiveUp,
    PlaceReplacements,
    PrepareCopy,
    RebuildState,
    RebuildStep,
    Rebuilt,
    ReportLoss,
    ReportProgress,
    ResetReplacements,
    StartOver,
    StartRebuild,
)
from dlrmflow.engine.serving.placement import choose_rebuild_worker, least_loaded_worker

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
        self.rebuild_id = ""  # the rebuild the replacements were last reset for
        self.done: list[bool] = []  # per chunk of the current copy: its task ended (failed: without installing)
        self.failed: list[bool] = []

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

    # ---- the rebuild thread and its copy tasks (RebuildDriver's part) ------------------------
    def rebuild_thread(self) -> Iterator[Blocked]:
        """The state's instructions carried out on the model, as ``RebuildDriver`` does: each lock hold (a
        transition and the instructions it wants done in that hold) is one step, and the thread yields
        wherever the driver holds no lock."""
        state = self.state
        interval = 0.0 if self.fix_up_every_chunk else math.inf
        step = self.in_hold(state.attempt_begun())
        while not isinstance(step, Rebuilt):
            if isinstance(step, StartOver):
                yield None
                step = state.attempt_begun()
            elif isinstance(step, PlaceReplacements):
                yield None  # placing replacements (no lock)
                placed = {s: self.place(s) for s in step.need}
                step = state.replacements_started(step, placed, 0.0)
            elif isinstance(step, PrepareCopy):
                yield None
                step = state.reset_begun(step)
            elif isinstance(step, CopyChunks):
                survivors = state.survivors(step.lost)
                replicas = {s: self.replica(state.replacement[s]) for s in step.lost}
                self.done, self.failed = [False] * len(step.chunks), [False] * len(step.chunks)
                for n, chunk in enumerate(step.chunks):
                    self.tasks.append(self.copy_task(chunk, survivors, replicas, self.rebuild_id, n,
                                                     self.done, self.failed))
                step = step.then
            elif isinstance(step, AwaitChunk):
                yield lambda n=step.n, g=step.generation, done=self.done: done[n] or not state.is_current(g)
                if not self.done[step.n]:
                    step = state.copy_task_superseded(step)
                elif self.failed[step.n]:
                    step = state.copy_task_failed(step, RuntimeError("a survivor's worker died"))
                else:
                    step = state.copy_task_done(step, ChunkCopied(2, 0.0, 0.0, 0.0), 0.0, interval)
            elif isinstance(step, ReportProgress):
                assert 0 < step.done <= step.total
                yield None
                step = step.then
            elif isinstance(step, EndCopy):
                yield None
                state.log_closed()
                yield None
                step = state.copy_ended(step, 0.0)
            else:
                raise AssertionError(f"not an instruction to carry out without the lock: {step}")
            step = self.in_hold(step)
        self.thread = None

    def place(self, s: int) -> tuple[str, None, Replica]:
        """A replacement for member ``s``, started on a worker of its own."""
        replica = Replica(self.initial[s])
        self.replicas[replica] = s
        return f"spare{next(self.ids)}", None, replica

    def in_hold(self, step: RebuildStep) -> RebuildStep:
        """Carry out the instructions the state wants done in the current lock hold."""
        state = self.state
        while step.in_hold and not isinstance(step, Rebuilt):
            if isinstance(step, ResetReplacements):  # steps 0 and 1: settle, reset the replacements, open the log
                self.deliver()
                self.rebuild_id = f"{step.generation}-{next(self.ids)}"
                for s in step.lost:
                    self.replica(state.replacement[s]).reset(self.rebuild_id)
                step = state.replacements_reset(step, self.stripes_to_copy(list(step.lost)), self.chunk)
            elif isinstance(step, FixUp):  # step 3
                if len(step.stripes):
                    self.deliver()  # the pending deltas go out with the re-read and land first
                    pieces = {s: self.held(s, step.stripes) for s in state.survivors(step.lost)}
                    decoded = self.code.decode(pieces, list(step.lost))
                    for s in step.lost:
                        self.replica(state.replacement[s]).install(step.stripes, decoded[s], self.rebuild_id)
                step = state.fix_up_done(step, 0.0)
            elif isinstance(step, FindDead):  # a task fails here only after its survivor's loss was reported
                raise AssertionError("a copy task failed with no loss reported")
            elif isinstance(step, ReportLoss):
                self.lose(step.members)
                step = step.then
            elif isinstance(step, FinishRebuild):
                if step.generation == state.generation:  # a finished rebuild: every stripe exact
                    for s in state.lost:
                        current = self.replica(state.replacement[s]).current()
                        assert np.array_equal(current.view(np.uint32), self.truth(s).view(np.uint32)), s
                    assert state.rebuild_finished(step.generation, 1.0)
                    self.finished += 1
                else:
                    assert not state.rebuild_finished(step.generation, 1.0)
                step = step.then
            elif isinstance(step, GiveUp):
                raise step.error
            self.check()
        return step

    def copy_task(self, chunk: np.ndarray, survivors: tuple[int, ...], replicas: dict[int, Replica],
                  rebuild_id: str, n: int, done: list[bool], failed: list[bool]) -> Iterator[Blocked]:
        """Reads the chunk from each survivor in turn (batches may land in between), decodes, installs."""
        if n:
            yield lambda: done[n - 1]  # the tasks run in chunk order
        pieces = {}
        for s in survivors:
            if s in self.state.lost:  # its worker died: the task fails
                done[n] = failed[n] = True
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


class OnWorkers(System):
    """A System whose members run on named workers, as on a LocalCluster: a standby replacement of every
    member on a spare worker, a killed worker's nanny starting it again under a new address, and
    replacements placed as ``rebuild.py`` places them (the member's standby when its worker lives, else
    :func:`choose_rebuild_worker`'s worker, else :func:`least_loaded_worker`'s)."""

    def __init__(self, k: int, r: int, n_stripes: int, **kw) -> None:
        super().__init__(k, r, n_stripes, **kw)
        self.listed = {f"w{s}": {"host": "127.0.0.1"} for s in range(k + r)} | {"spare": {"host": "127.0.0.1"}}
        self.killed: list[str] = []
        standbys = {}
        for s in range(k + r):
            replica = Replica(self.initial[s])
            self.replicas[replica] = s
            standbys[s] = ("spare", None, replica)
        self.state.standbys_set(standbys)

    def worker_hosting(self, s: int) -> str | None:
        """The worker of member ``s``'s live actor: its own, or its replacement's (None: none placed)."""
        state = self.state
        if s not in state.lost:
            return state.worker_of[s]
        return state.replacement_workers[s] if s in state.replacement else None

    def kill_worker(self, worker: str) -> set[int]:
        """SIGKILL ``worker``: every member and replacement on it is lost (the trainer notices, here at
        once); its nanny starts a worker again, under a new address. The members lost."""
        on_it = {s for s in range(self.k + self.r) if self.worker_hosting(s) == worker}
        del self.listed[worker]
        self.killed.append(worker)
        self.listed[f"{worker}+{len(self.killed)}"] = {"host": "127.0.0.1"}
        if on_it:
            self.lose(on_it)
        return on_it

    def place(self, s: int) -> tuple[str, None, Replica]:
        """Member ``s``'s standby, else a new replacement; never on a worker that died, nor on one that
        hosts another member while a free one is listed."""
        state = self.state
        standby = state.take_standby(s)
        if standby is not None and standby[0] in self.listed:
            placed = standby
        else:
            busy, dead = state.busy_workers(), state.dead_workers
            worker = choose_rebuild_worker(self.listed, busy, dead) or least_loaded_worker(self.listed, busy, dead)
            assert worker is not None
            replica = Replica(self.initial[s])
            self.replicas[replica] = s
            placed = (worker, None, replica)
        assert placed[0] not in self.killed and placed[0] not in state.busy_workers(), (s, placed[0])
        return placed


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
        generation, finished = system.state.generation, system.finished
        system.lose({second})
        assert system.state.generation == generation + 1
        assert system.state.rebuilt is None and system.state.dirty is None
        system.write(5)
        driver.run_out()
        assert not system.state.lost
        if not finished:  # the same recovery, started over
            assert at < steps
            assert system.finished == 1 and system.state.current_record().restarts == 1
        else:  # after the first rebuild finished (the same thread rebuilds it): a recovery of its own
            assert system.finished == 2 and system.state.current_record().restarts == 0


def test_stale_transitions_change_nothing():
    state = RebuildState(ErasureCode(2, 2), 4, [0, 1, 2, 3], [None] * 4, ["a", "b", "c", "d"])
    assert isinstance(state.member_lost({0}, None, 0.0), StartRebuild)
    place = state.attempt_begun()
    assert isinstance(place, PlaceReplacements) and (place.lost, place.need) == ((0,), (0,))
    generation = place.generation
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
    give_up = state.attempt_begun()
    assert isinstance(give_up, GiveUp) and give_up.error is state.fatal


def test_the_first_fix_up_adds_the_generated_stripes_and_a_logged_one_is_re_read():
    state = RebuildState(ErasureCode(2, 1), 6, [0, 1, 2], [None] * 3, ["a", "b", "c"])
    state.member_lost({1}, None, 0.0)
    generation = state.attempt_begun().generation
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
    done = state.attempt_begun()
    assert isinstance(done, Rebuilt) and done.record.rebuilt_at == 2.0 and not state.recovering


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


def _check_hosts(system: OnWorkers) -> None:
    """Every member is rebuilt, on a live worker: every recovery record names the workers it chose, the
    latest ones are the members' workers, and no worker this system killed hosts a member again."""
    state = system.state
    assert not state.lost and not state.replacement and state.rebuilt is None
    assert set(system.killed) <= state.dead_workers
    assert all(record.rebuilt_at is not None for record in state.recoveries)
    for s, worker in enumerate(state.worker_of):
        assert worker in system.listed and worker not in state.dead_workers, (s, worker)
        latest = [record.workers[s] for record in state.recoveries if s in record.workers]
        assert not latest or latest[-1] == worker
    for record in state.recoveries:
        assert sorted(record.workers) == record.members


def test_a_member_lost_again_after_its_rebuild_is_rebuilt_again_on_a_live_worker():
    """K = 2, R = 1: data shard 0's worker is killed, the standby on the spare worker takes its place;
    then the spare is killed (shard 0 lost again): a second recovery of its own, on a worker started
    since, never one that died; both rebuilds exact, with batches before, between and during them."""
    system = OnWorkers(2, 1, 8, chunk=2, fix_up_every_chunk=True, seed=3)
    for _ in range(3):
        system.write(4)
    system.deliver()
    driver = Driver(system)
    assert system.kill_worker("w0") == {0}
    for _ in range(5):
        driver.step_system()
    system.write(5)
    driver.run_out()
    state = system.state
    (first,) = state.recoveries
    assert first.members == [0] and first.workers == {0: "spare"} and first.restarts == 0
    assert state.worker_of == ["spare", "w1", "w2"] and state.dead_workers == {"w0"}
    system.write(6)
    system.deliver()
    assert system.kill_worker("spare") == {0}  # the replacement's worker: shard 0 is lost again
    assert state.lost == {0} and state.dead_workers == {"w0", "spare"}
    for _ in range(4):
        driver.step_system()
        system.write(3)
    driver.run_out()
    first_again, second = state.recoveries
    assert first_again is first and first.workers == {0: "spare"}  # the first record is left as it was
    assert second.members == [0] and second.restarts == 0 and second.rebuilt_at is not None
    assert second.workers[0] in {"w0+1", "spare+2"}  # started since; the standbys died with the spare
    assert state.worker_of == [second.workers[0], "w1", "w2"] and system.finished == 2
    _check_hosts(system)


@pytest.mark.parametrize("seed", range(30))
def test_members_killed_again_and_again_are_rebuilt_exactly_each_time(seed):
    """Random rounds of kills (K = 2, R = 1; K = 2, R = 2; K = 3, R = 2), each of up to R workers, most
    of them the worker of a member already rebuilt (its replacement's), some during a rebuild (a member
    or the replacement being built dies), with random writes, deliveries and steps between: every round
    starts a recovery of its own, every rebuild ends exact, and no member is ever placed on a worker that
    died."""
    rng = np.random.default_rng(2000 + seed)
    k, r = [(2, 1), (2, 2), (3, 2)][seed % 3]
    system = OnWorkers(k, r, 6, chunk=int(rng.integers(1, 4)), fix_up_every_chunk=bool(rng.integers(0, 2)),
                       seed=seed)
    for _ in range(2):
        system.write(4)
    system.deliver()
    driver = Driver(system)
    again = 0
    for round_ in range(5):
        first = int(rng.integers(0, k + r)) if round_ == 0 or rng.random() < 0.3 else again
        before = len(system.state.recoveries)
        system.kill_worker(system.worker_hosting(first))
        for _ in range(int(rng.integers(0, 30))):
            roll = rng.random()
            if roll < 0.3:
                system.write(int(rng.integers(1, 5)))
            elif roll < 0.4:
                system.deliver()
            elif roll < 0.45 and len(system.state.lost) < r:  # a further loss: the same recovery restarts
                worker = system.worker_hosting(int(rng.integers(0, k + r)))
                if worker is not None:
                    system.kill_worker(worker)
            else:
                ready = driver.ready()
                if ready:
                    driver.advance(ready[int(rng.integers(0, len(ready)))])
        driver.run_out()
        assert first in system.state.recoveries[before].members  # a recovery of its own (a further loss
        _check_hosts(system)  # after it was rebuilt: another)
        again = first
    assert len(system.state.recoveries) >= 5 and system.finished >= 5


# ---- the rebuild thread's instructions, with random outcomes ----------------------------------------
class NobodyDead(RuntimeError):
    """A copy task's failure while every member answers: not a loss, so fatal."""


class Scripted:
    """``RebuildDriver``'s part with every outcome drawn at random, and no members or data: placements
    and waits that see a further loss, copy tasks, resets and fix-ups that find members lost, copy tasks
    that fail with every member alive, and members the trainer finds lost between two lock holds.
    ``budget`` further losses at most (past R, a loss is fatal). It checks what each instruction asks for."""

    def __init__(self, k: int, r: int, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.k, self.r, self.n = k, r, k + r
        self.state = RebuildState(ErasureCode(k, r), 10, [f"m{s}" for s in range(self.n)], [None] * self.n,
                                  [f"w{s}" for s in range(self.n)])
        self.budget = int(self.rng.integers(0, r + 2))
        self.losses = 0  # member_lost calls that did not raise
        self.generations: list[int] = []  # the generation of each attempt
        self.interval = float(self.rng.choice([0.0, 0.5, math.inf]))  # FIX_UP_INTERVAL_S
        self.copy: CopyChunks | None = None
        self.progress: list[tuple[int, int]] = []  # of the current copy
        self.dead: set[int] = set()  # who a FindDead finds
        self.steps = 0

    def member(self) -> int:
        return int(self.rng.integers(0, self.n))

    def lose(self, members: set[int]) -> None:
        """CodedShardGroup.on_lost (raises TooManyErasuresError past R)."""
        self.state.member_lost(set(members), RuntimeError(f"lost {sorted(members)}"), 0.0)
        self.losses += 1

    def found_lost(self, p: float) -> set[int]:
        """With probability ``p``, while the budget lasts: a member (or its replacement) found lost."""
        if self.budget and self.rng.random() < p:
            self.budget -= 1
            return {self.member()}
        return set()

    def trainer(self) -> None:
        """Between two lock holds, a write-back batch may find a member lost."""
        lost = self.found_lost(0.1)
        if lost:
            with contextlib.suppress(TooManyErasuresError):  # fatal: the thread sees it at its next report
                self.lose(lost)

    def check_lost(self, lost: tuple[int, ...]) -> None:
        """The state never rebuilds more than the parity allows: at most R members, exactly those lost."""
        assert 1 <= len(lost) <= self.r and lost == tuple(sorted(lost))
        assert self.state.fatal is not None or set(lost) <= self.state.lost

    def run(self) -> Rebuilt | BaseException:
        """The rebuild thread from the first loss to its end: Rebuilt, or the error it ends with."""
        assert isinstance(self.state.member_lost({self.member()}, RuntimeError("first"), 0.0), StartRebuild)
        self.losses += 1
        step: RebuildStep = StartOver()
        try:
            while not isinstance(step, Rebuilt):
                self.steps += 1
                # Each attempt takes a bounded number of steps, and a new one needs a further loss.
                assert self.steps <= (self.losses + 1) * 50, "the rebuild never ends"
                step = self.in_hold(self.unlocked(step))
        except (TooManyErasuresError, NobodyDead) as exc:
            if self.copy is not None:  # RebuildDriver.abandon_copy
                self.state.log_closed()
                self.state.copy_ended(EndCopy(self.copy.generation), 0.0)
            return exc
        return step

    def unlocked(self, step: RebuildStep) -> RebuildStep:
        state = self.state
        if isinstance(step, PlaceReplacements):  # as the hold that gave it left the state
            assert step.generation == state.generation and step.lost == tuple(sorted(state.lost))
            assert step.need == tuple(s for s in step.lost if s not in state.replacement)
            self.generations.append(step.generation)
            self.check_lost(step.lost)
        self.trainer()
        if isinstance(step, StartOver):
            return state.attempt_begun()
        if isinstance(step, PlaceReplacements):
            self.trainer()
            if not state.is_current(step.generation) and self.rng.random() < 0.5:
                return state.placement_superseded(step)
            placed = {s: (f"spare{self.steps}-{s}", None, f"r{self.steps}-{s}") for s in step.need}
            return state.replacements_started(step, placed, 0.0)
        if isinstance(step, PrepareCopy):
            return state.reset_begun(step)
        if isinstance(step, CopyChunks):
            self.check_lost(step.lost)
            assert step.worker == state.replacement_workers[step.lost[0]]
            self.copy, self.progress = step, []
            return step.then
        if isinstance(step, AwaitChunk):
            assert self.copy is not None and step.generation == self.copy.generation
            self.trainer()
            if not state.is_current(step.generation):  # the wait sees the loss, or the task's failure first
                if self.rng.random() < 0.5:
                    return state.copy_task_superseded(step)
                return state.copy_task_failed(step, OSError("a worker died"))
            self.dead = self.found_lost(0.1)
            if self.dead or self.rng.random() < 0.02:
                return state.copy_task_failed(step, NobodyDead("the task failed") if not self.dead else
                                              OSError("a worker died"))
            copied = ChunkCopied(len(self.copy.chunks[step.n]), 0.1, 0.0, 0.0)
            return state.copy_task_done(step, copied, float(self.rng.random()), self.interval)
        if isinstance(step, ReportProgress):
            assert 0 < step.done <= step.total and (not self.progress or step.done > self.progress[-1][0])
            self.progress.append((step.done, step.total))
            return step.then
        if isinstance(step, EndCopy):
            assert self.copy is not None and step.generation == self.copy.generation
            state.log_closed()
            self.copy = None
            return state.copy_ended(step, 0.0)
        raise AssertionError(f"not an instruction to carry out without the lock: {step}")

    def in_hold(self, step: RebuildStep) -> RebuildStep:
        state = self.state
        while step.in_hold and not isinstance(step, Rebuilt):
            if isinstance(step, ResetReplacements):
                self.check_lost(step.lost)
                assert all(s in state.replacement for s in step.lost)
                lost = self.found_lost(0.1)
                if lost:
                    step = state.reset_failed(step, lost, RuntimeError("reset"))
                else:
                    to_copy = np.flatnonzero(self.rng.random(state.n_stripes) < 0.5)
                    step = state.replacements_reset(step, to_copy, int(self.rng.integers(1, 4)))
            elif isinstance(step, FixUp):
                self.check_lost(step.lost)
                assert step.generation == self.copy.generation and state.is_current(step.generation)
                lost = self.found_lost(0.1)
                step = state.fix_up_failed(step, lost, RuntimeError("fix-up")) if lost else \
                    state.fix_up_done(step, 0.0)
            elif isinstance(step, FindDead):
                step = state.dead_found(step, self.dead, RuntimeError(f"lost {sorted(self.dead)}"))
            elif isinstance(step, ReportLoss):
                assert step.members
                self.lose(step.members)
                step = step.then
            elif isinstance(step, FinishRebuild):
                if step.generation == state.generation:  # every stripe is rebuilt, every copied one reported
                    assert state.rebuilt.all() and state.fatal is None
                    assert self.progress == [] or self.progress[-1][0] == self.progress[-1][1]
                    assert state.rebuild_finished(step.generation, 1.0)
                else:
                    assert not state.rebuild_finished(step.generation, 1.0)
                step = step.then
            elif isinstance(step, GiveUp):
                raise step.error
        return step


@pytest.mark.parametrize("k, r", [(2, 1), (2, 2), (3, 2)])
@pytest.mark.parametrize("seed", range(150))
def test_random_failures_end_in_a_rebuild_or_a_clear_give_up(k, r, seed):
    """Whatever fails when: the thread never rebuilds more than R members, starts over only after a
    further loss (each attempt has a generation of its own), and ends, rebuilt or with the error that
    made it give up; the records count every loss once."""
    scripted = Scripted(k, r, seed=1000 * r + seed)
    end = scripted.run()
    state = scripted.state
    assert scripted.generations == sorted(set(scripted.generations))  # every restart follows a new loss
    assert state.dirty is None  # the log is closed, however the thread ended
    records = state.recoveries
    assert len(records) + sum(record.restarts for record in records) == scripted.losses
    if isinstance(end, Rebuilt):
        assert not state.lost and not state.recovering and state.fatal is None
        assert all(record.rebuilt_at is not None for record in records) and end.record is records[-1]
        ever_lost = set().union(*(record.members for record in records))
        assert all(state.members[s] != f"m{s}" and state.target(s) is state.members[s] for s in ever_lost)
    elif isinstance(end, TooManyErasuresError):
        assert state.fatal is end and len(state.lost) > r
    else:  # a copy task failed and every member answered: its failure ends the thread
        assert isinstance(end, NobodyDead) and state.fatal is None


def _state_with_replacement(k: int, r: int, lost: set[int]) -> tuple[RebuildState, PrepareCopy]:
    state = RebuildState(ErasureCode(k, r), 6, list(range(k + r)), [None] * (k + r), [f"w{s}" for s in range(k + r)])
    state.member_lost(lost, None, 0.0)
    place = state.attempt_begun()
    placed = {s: (f"spare{s}", None, f"r{s}") for s in place.need}
    prepare = state.replacements_started(place, placed, 0.25)
    assert isinstance(prepare, PrepareCopy) and state.current_record().placement_seconds == 0.25
    return state, prepare


@pytest.mark.parametrize("interval, fix_ups", [(0.0, 3), (0.5, 2), (math.inf, 1)])
def test_a_fix_up_waits_for_the_chunks_copied_within_the_interval(interval, fix_ups):
    """Chunk 0 comes 0.1 s after the copy was submitted, chunk 1 0.6 s after it (no fix-up yet), chunk 2 0.3 s
    after the last fix-up: with FIX_UP_INTERVAL_S 0.5 chunk 0 waits for chunk 1, and the last chunk's fix-up
    never waits. The copy then ends and the rebuild finishes."""
    state, prepare = _state_with_replacement(2, 1, {1})
    reset = state.reset_begun(prepare)
    assert isinstance(reset, ResetReplacements) and reset.lost == (1,)
    copy = state.replacements_reset(reset, np.array([0, 1, 2, 3, 5]), 2)
    assert isinstance(copy, CopyChunks) and [c.tolist() for c in copy.chunks] == [[0, 1], [2, 3], [5]]
    assert copy.worker == "spare1" and copy.then == AwaitChunk(copy.generation, 0)
    step, progress = copy.then, []
    for n, since in enumerate([0.1, 0.6, 0.3]):
        assert step == AwaitChunk(copy.generation, n)
        step = state.copy_task_done(step, ChunkCopied(len(copy.chunks[n]), 1.0, 0.0, 0.0), since, interval)
        if isinstance(step, FixUp):
            assert step.lost == (1,)
            step = state.fix_up_done(step, 0.01)
            progress.append((step.done, step.total))
            step = step.then
    assert isinstance(step, EndCopy) and progress[-1] == (5, 5) and len(progress) == fix_ups
    record = state.current_record()
    assert (record.chunks, record.stripes, record.rows_rebuilt, record.fix_ups) == (3, 5, 5, fix_ups)
    state.log_closed()
    finish = state.copy_ended(step, 2.0)
    assert finish == FinishRebuild(copy.generation, StartOver()) and record.copy_seconds == 2.0
    assert state.rebuild_finished(finish.generation, 3.0)
    assert state.attempt_begun() == Rebuilt(record) and not state.recovering


def test_a_copy_with_nothing_to_copy_ends_at_once_and_finishes():
    state, prepare = _state_with_replacement(2, 2, {0, 3})
    copy = state.replacements_reset(state.reset_begun(prepare), np.zeros(0, np.int64), 4)
    assert copy.chunks == () and copy.then == EndCopy(copy.generation) and state.rebuilt.all()
    state.log_closed()
    assert isinstance(state.copy_ended(copy.then, 0.0), FinishRebuild)


def test_a_failed_copy_task_asks_who_died_and_gives_up_when_nobody_did():
    state, prepare = _state_with_replacement(2, 1, {0})
    copy = state.replacements_reset(state.reset_begun(prepare), np.arange(4), 2)
    failure = OSError("the task failed")
    find = state.copy_task_failed(copy.then, failure)
    assert find == FindDead(copy.generation, failure)
    assert state.dead_found(find, set(), RuntimeError("nobody")) == GiveUp(failure)
    cause = RuntimeError("members [2] lost")
    report = state.dead_found(find, {2}, cause)
    assert isinstance(report, ReportLoss) and report.members == {2} and report.cause is cause
    assert report.then == EndCopy(copy.generation)


def test_a_loss_during_the_copy_ends_it_and_the_thread_starts_over():
    state, prepare = _state_with_replacement(3, 2, {1})
    copy = state.replacements_reset(state.reset_begun(prepare), np.arange(6), 2)
    state.member_lost({4}, RuntimeError("parity shard 1"), 0.0)  # the trainer, while chunk 0 is copied
    assert state.copy_task_done(copy.then, ChunkCopied(2, 0.1, 0.0, 0.0), 0.0, 0.5) == EndCopy(copy.generation)
    state.log_closed()
    assert state.copy_ended(EndCopy(copy.generation), 1.0) == StartOver()
    place = state.attempt_begun()
    assert isinstance(place, PlaceReplacements) and place.generation == copy.generation + 1
    assert (place.lost, place.need) == ((1, 4), (4,))  # member 1 keeps its replacement
    assert state.current_record().restarts == 1


def test_a_fatal_loss_after_the_last_fix_up_gives_up_instead_of_finishing():
    """A loss past R keeps the generation and adds a member with no replacement: the complete copy must
    not swap replacements in."""
    state, prepare = _state_with_replacement(2, 1, {0})
    copy = state.replacements_reset(state.reset_begun(prepare), np.arange(2), 2)
    fix = state.copy_task_done(copy.then, ChunkCopied(2, 0.1, 0.0, 0.0), 0.0, 0.5)
    assert isinstance(state.fix_up_done(fix, 0.0).then, EndCopy)
    with pytest.raises(TooManyErasuresError):
        state.member_lost({1}, None, 0.0)
    state.log_closed()
    assert state.copy_ended(EndCopy(copy.generation), 0.0) == GiveUp(state.fatal)
    assert state.members == [0, 1, 2]


def test_an_outcome_for_another_attempt_or_chunk_is_refused():
    state, prepare = _state_with_replacement(2, 1, {0})
    copy = state.replacements_reset(state.reset_begun(prepare), np.arange(4), 2)
    with pytest.raises(RuntimeError, match="chunk 1 reported where chunk 0"):
        state.copy_task_done(AwaitChunk(copy.generation, 1), ChunkCopied(2, 0.1, 0.0, 0.0), 0.0, 0.5)
    with pytest.raises(RuntimeError, match="no attempt running"):
        state.copy_task_superseded(AwaitChunk(copy.generation + 1, 0))
