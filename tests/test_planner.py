"""The oracle cacher: chunked == sequential == a naive reference, plan validity, errors, plan files."""

from __future__ import annotations

import itertools
import json
import logging
import shutil
from collections import deque
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlrmflow.datasets.writer import write_array_dataset
from dlrmflow.engine.batch_stream import BatchStream, global_ids
from dlrmflow.engine.planning import lookahead, planner
from dlrmflow.engine.planning.lookahead import PlanConsistencyError, assign_slots, farthest_first_drops, iter_id_batches
from dlrmflow.engine.planning.planner import (
    CapacityError,
    PlanArrays,
    PlanConfig,
    PlanError,
    PlanMismatchError,
    load_plan,
    make_plan,
    plan_chunked,
    plan_sequential,
    write_plan,
)

# ---- helpers --------------------------------------------------------------------------------


def power_law_ids(rng: np.random.Generator, card: int, n: int, skew: float) -> np.ndarray:
    weights = np.arange(1, card + 1, dtype=np.float64) ** -skew
    cdf = np.cumsum(weights) / weights.sum()
    ranks = np.minimum(np.searchsorted(cdf, rng.random(n), side="right"), card - 1)
    return rng.permutation(card)[ranks]  # hot rows anywhere in the table, not only at id 0


def make_dataset(path: Path, seed: int, rows: int, cards: list[int], *, skew: float = 1.1,
                 rows_per_file: int | None = None) -> Path:
    rng = np.random.default_rng(seed)
    sparse = np.stack([power_law_ids(rng, c, rows, skew) for c in cards], axis=1)
    write_array_dataset(path, rng.integers(0, 2, rows), rng.random((rows, 2), dtype=np.float32), sparse, cards,
                        rows_per_file=rows_per_file or max(rows, 1))
    return path


def stream_sets(dataset: Path, batch_size: int, drop_last: bool = False) -> list[set[int]]:
    stream = BatchStream(dataset, batch_size, drop_last=drop_last)
    return [set(global_ids(b.sparse, stream.offsets).ravel().tolist()) for b in stream]


def naive_plan(batches: list[set[int]], L: int, P: int, C: int | None):
    """The plan straight from the definitions, with Python sets (slow, obviously right)."""
    T = len(batches)
    uses: dict[int, list[int]] = {}
    for t, b in enumerate(batches):
        for x in b:
            uses.setdefault(x, []).append(t)
    prefetch = [set() for _ in range(T)]
    evict = [set() for _ in range(T)]
    gaps = []  # kept gaps that cost a slot: (end, id, start) of the times they cost it
    for x, ts in uses.items():
        prefetch[ts[0]].add(x)
        for a, b in itertools.pairwise(ts):
            if b - a > L:
                evict[a].add(x)
                prefetch[b].add(x)
            elif b - a >= P + 2:
                gaps.append((b - P - 1, x, a + 1))
        evict[ts[-1]].add(x)
    if C is not None:
        need = [len(set().union(*batches[u : u + P + 1])) for u in range(T)]
        if T and max(need) > C:
            return None
        dropped = set()
        for u in range(T):
            live = [g for g in gaps if g[2] <= u <= g[0] and g not in dropped]
            while need[u] + len(live) > C:
                victim = max(live)  # farthest end, then larger id
                live.remove(victim)
                dropped.add(victim)
        for end, x, start in dropped:
            evict[start - 1].add(x)
            prefetch[end + P + 1].add(x)

    def replay(num_slots: int):
        free, slot_of, slots, peak = deque(range(num_slots)), {}, [None] * T, 0

        def issue(t):
            slots[t] = []
            for x in sorted(prefetch[t]):
                assert x not in slot_of
                slot_of[x] = free.popleft()
                slots[t].append(slot_of[x])

        for t in range(min(P, T - 1) + 1):
            issue(t)
        peak = len(slot_of)
        for u in range(1, T):
            for x in sorted(evict[u - 1]):
                free.append(slot_of.pop(x))
            if u + P < T:
                issue(u + P)
            peak = max(peak, len(slot_of))
        return slots, peak

    _, peak = replay(sum(len(p) for p in prefetch))
    num_slots = C if C is not None else peak
    slots, _ = replay(num_slots)
    return prefetch, slots, evict, num_slots, peak


def assert_matches_naive(plan: PlanArrays, naive) -> None:
    prefetch, slots, evict, num_slots, peak = naive
    assert plan.num_slots == num_slots and plan.peak_occupancy == peak
    for t in range(plan.num_iterations):
        step = plan.iteration(t)
        assert step.prefetch_ids.tolist() == sorted(prefetch[t]), f"prefetch of iteration {t}"
        assert step.prefetch_slots.tolist() == slots[t], f"slots of iteration {t}"
        assert step.evict_ids.tolist() == sorted(evict[t]), f"evictions after iteration {t}"


def assert_same_plan(a: PlanArrays, b: PlanArrays) -> None:
    for field in ("prefetch_offsets", "prefetch_ids", "prefetch_slots", "evict_offsets", "evict_ids"):
        assert np.array_equal(getattr(a, field), getattr(b, field)), field
    assert a.summary() == b.summary()


def replay_trainer(batches: list[set[int]], plan: PlanArrays) -> None:
    """Execute the plan with the trainer's timing and check every promise of the contract."""
    P, T = plan.config.prefetch_distance, plan.num_iterations
    slot_of: dict[int, int] = {}
    owner: dict[int, int] = {}

    def issue(t):
        step = plan.iteration(t)
        for x, s in zip(step.prefetch_ids.tolist(), step.prefetch_slots.tolist(), strict=True):
            assert x not in slot_of, f"row {x} fetched for {t} while still cached: stale read"
            assert 0 <= s < plan.num_slots and s not in owner, f"slot {s} for row {x} is not free"
            slot_of[x], owner[s] = s, x

    def release(v):
        for x in plan.iteration(v).evict_ids.tolist():
            del owner[slot_of.pop(x)]

    for t in range(min(P, T - 1) + 1):
        issue(t)
    for u in range(T):
        if u:
            release(u - 1)
            if u + P < T:
                issue(u + P)
        assert batches[u] <= slot_of.keys(), f"iteration {u} computes with rows missing from the cache"
        if plan.config.capacity is not None:
            assert len(slot_of) <= plan.config.capacity
    if T:
        release(T - 1)
    assert not slot_of, "rows left in the cache after the last iteration"


def random_case(rng: np.random.Generator, tmp_path: Path, i: int):
    cards = [int(c) for c in rng.choice([1, 3, 20, 60, 150, 400, 1000], size=rng.integers(1, 4))]
    rows = int(rng.integers(0, 500)) if i % 10 else 0
    dataset = make_dataset(tmp_path / f"ds{i}", i, rows, cards, skew=float(rng.uniform(0.5, 2.0)),
                           rows_per_file=int(rng.integers(1, 120)))
    L = int(rng.integers(1, 16))
    P = int(rng.integers(1, (L if i % 3 == 0 else min(L, 3)) + 1))  # mostly P << L: room for the bound
    B = int(rng.integers(1, 12))
    drop_last = bool(rng.integers(0, 2))
    return dataset, B, L, P, drop_last


# ---- the batch reader ------------------------------------------------------------------------


@pytest.mark.parametrize("block_rows", [1 << 16, 50, 7])
def test_id_reader_equals_batch_stream(tmp_path, monkeypatch, block_rows):
    monkeypatch.setattr(lookahead, "BLOCK_ROWS", block_rows)  # several blocks per row group
    dataset = make_dataset(tmp_path / "ds", 0, 1000, [7, 300, 1, 45], rows_per_file=370)
    for part in sorted(dataset.glob("part-*.parquet"))[1:]:  # several row groups per file, of odd sizes
        pq.write_table(pq.read_table(part), part, row_group_size=23)
    for batch_size, drop_last in [(1, False), (16, True), (64, False), (100, True), (1000, False), (2000, False)]:
        stream = BatchStream(dataset, batch_size, drop_last=drop_last)
        expected = [global_ids(b.sparse, stream.offsets) for b in stream]
        for tables in (range(4), range(1, 3), range(3, 4)):
            for first, stop in [(0, len(stream)), (len(stream) // 3, len(stream))]:
                got = list(iter_id_batches(stream, first, stop, tables))
                assert [t for t, _ in got] == list(range(first, stop))
                for t, ids in got:
                    assert np.array_equal(ids, expected[t][:, tables].T)
                # With a reused buffer a batch is valid until the next one: check each on arrival.
                reused = [(t, ids.copy()) for t, ids in iter_id_batches(stream, first, stop, tables, reuse_buffer=True)]
                assert all(np.array_equal(ids, expected[t][:, tables].T) for t, ids in reused)
                assert len(reused) == stop - first


# ---- plans equal the naive reference, chunked equals sequential -------------------------------


@pytest.fixture(params=["auto", "map", "map-switching"])
def last_uses(request, monkeypatch):
    """How a decision pass holds its last uses: as it chooses (these datasets are small: a dense array), or
    a hash map from tiny tables (many rebuilds and expiries), alone or switching to the dense array where that
    becomes the smaller (no allowance for a dense array), in the middle of a pass. Every way gives the same
    plan."""
    if request.param != "auto":
        monkeypatch.setattr(lookahead.IdMap, "MIN_BITS", 2)
        monkeypatch.setattr(lookahead, "DENSE_LAST_USES_BYTES", 0 if request.param == "map-switching" else None)
    return request.param


def cases_for(last_uses: str) -> int:
    """Random cases per test: 40 the way a pass chooses on these datasets, 15 for each forced hash-map way (the
    map's own operations are checked against a dict in test_id_map_equals_a_dict)."""
    return 40 if last_uses == "auto" else 15


def capacity_bounds(batches, L: int, P: int) -> tuple[int, int]:
    """The fewest slots any plan needs (the rows of P + 1 consecutive batches) and the unbounded plan's peak."""
    need = max((len(set().union(*batches[u : u + P + 1])) for u in range(len(batches))), default=1)
    return need, naive_plan(batches, L, P, None)[4]


def test_sequential_plan_equals_naive_reference(tmp_path, last_uses):
    rng = np.random.default_rng(1)
    for i in range(cases_for(last_uses)):
        dataset, B, L, P, drop_last = random_case(rng, tmp_path, i)
        batches = stream_sets(dataset, B, drop_last)
        need, peak = capacity_bounds(batches, L, P)  # between need and peak the bound bites
        for capacity in (None, need, int(rng.integers(need, max(peak, need) + 1)), max(need - 1, 1)):
            config = PlanConfig(B, L, P, capacity, drop_last)
            naive = naive_plan(batches, L, P, capacity)
            if naive is None:
                with pytest.raises(CapacityError):
                    plan_sequential(dataset, config)
                continue
            plan = plan_sequential(dataset, config)
            assert_matches_naive(plan, naive)
            replay_trainer(batches, plan)


def test_chunked_plan_equals_sequential(tmp_path, last_uses):
    rng = np.random.default_rng(2)
    for i in range(cases_for(last_uses)):
        dataset, B, L, P, drop_last = random_case(rng, tmp_path, i)
        batches = stream_sets(dataset, B, drop_last)
        need, peak = capacity_bounds(batches, L, P)
        capacity = [None, need, max(1, (need + peak) // 2)][i % 3]
        config = PlanConfig(B, L, P, capacity, drop_last)
        reference = plan_sequential(dataset, config)
        for _ in range(3):
            chunk = int(rng.integers(1, max(len(batches), 1) + 2))
            groups = int(rng.integers(1, 5))
            assert_same_plan(plan_chunked(dataset, config, chunk_iterations=chunk, table_groups=groups), reference)


def test_chunked_plan_on_dask_equals_sequential(tmp_path):
    from dlrmflow.engine.serving.cluster import dask_client

    dataset = make_dataset(tmp_path / "ds", 3, 3000, [5, 900, 40, 2000, 13], rows_per_file=700)
    configs = [PlanConfig(32, 6, 2), PlanConfig(25, 10, 4, capacity=700, drop_last=True), PlanConfig(64, 3, 3)]
    with dask_client(None, n_workers=2) as client:
        for config in configs:
            reference = plan_sequential(dataset, config)
            done = []
            plan = plan_chunked(dataset, config, client=client, chunk_iterations=7,
                                progress=lambda d, n, done=done: done.append((d, n)))
            assert_same_plan(plan, reference)
            chunks = -(-reference.num_iterations // 7)
            steps = chunks * 2 + chunks  # chunks x one table group per worker, then each chunk assembled
            assert done == [(i, steps) for i in range(1, steps + 1)]


# ---- the capacity bound --------------------------------------------------------------------------


def naive_greedy(over: list[int], intervals: list[tuple[int, int, int]]) -> set[int]:
    dropped: set[int] = set()
    for u in range(len(over)):
        live = [i for i, (s, e, _) in enumerate(intervals) if s <= u <= e and i not in dropped]
        excess = over[u] - sum(1 for i in dropped if intervals[i][0] <= u <= intervals[i][1])
        while excess > 0:
            i = max(live, key=lambda j: (intervals[j][1], intervals[j][2]))
            live.remove(i)
            dropped.add(i)
            excess -= 1
    return dropped


@st.composite
def interval_problems(draw):
    n = draw(st.integers(1, 12))
    # One interval per id (a row's own gaps never overlap); ties on the end are common.
    raw = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1), st.integers(0, 20)),
                        max_size=10, unique_by=lambda r: r[2]))
    intervals = [(min(a, b), max(a, b), x) for a, b, x in raw]
    cover = [sum(1 for s, e, _ in intervals if s <= u <= e) for u in range(n)]
    base_room = [draw(st.integers(-3, 2)) for _ in range(n)]
    over = [min(c + r, c) for c, r in zip(cover, base_room, strict=True)]  # dropping all always suffices
    return over, intervals


@settings(max_examples=300, deadline=None)
@given(interval_problems())
def test_farthest_first_drops_is_the_greedy_and_optimal(problem):
    over, intervals = problem
    s, e, x = (np.array([iv[k] for iv in intervals], dtype=np.int64) for k in range(3))
    got = farthest_first_drops(np.array(over, dtype=np.int64), s, e, x)
    assert set(np.flatnonzero(got).tolist()) == naive_greedy(over, intervals)
    # No smaller set of drops fixes every time (brute force): the greedy keeps the most gaps.
    def feasible(drop):
        return all(over[u] - sum(1 for i in drop if s[i] <= u <= e[i]) <= 0 for u in range(len(over)))

    assert feasible(set(np.flatnonzero(got).tolist()))
    smaller = int(got.sum()) - 1
    if smaller >= 0:
        assert not any(feasible(set(c)) for c in itertools.combinations(range(len(intervals)), smaller))


def test_capacity_error_names_the_iteration_and_numbers(tmp_path):
    dataset = make_dataset(tmp_path / "ds", 4, 200, [50, 30], skew=0.3)
    batches = stream_sets(dataset, 20)
    sizes = [len(b) for b in batches]
    t = int(np.argmax(sizes))
    with pytest.raises(CapacityError) as err:
        plan_sequential(dataset, PlanConfig(20, 5, 1, capacity=max(sizes) - 1))
    first_too_big = next(u for u, n in enumerate(sizes) if n > max(sizes) - 1)
    assert f"iteration {first_too_big} alone uses {sizes[first_too_big]} unique rows" in str(err.value)
    assert t >= first_too_big
    # Big enough for each iteration, not for an iteration plus the P prefetched after it.
    pair = [len(batches[u] | batches[u + 1]) for u in range(len(batches) - 1)]
    with pytest.raises(CapacityError, match="prefetch distance 1") as err:
        plan_sequential(dataset, PlanConfig(20, 5, 1, capacity=max(sizes)))
    assert f"smallest capacity this stream allows with P=1 is {max(pair)} rows" in str(err.value)
    plan_sequential(dataset, PlanConfig(20, 5, 1, capacity=max(pair)))


# ---- consistency ------------------------------------------------------------------------------


def test_configs_that_could_read_stale_rows_are_rejected():
    with pytest.raises(PlanError, match="stale read"):
        PlanConfig(16, lookahead=3, prefetch_distance=4)
    with pytest.raises(PlanError, match="1..L"):
        PlanConfig(16, lookahead=3, prefetch_distance=0)
    with pytest.raises(PlanError):
        PlanConfig(0)
    with pytest.raises(PlanError):
        PlanConfig(16, capacity=0)


def test_slot_assignment_rejects_a_prefetch_before_the_write_back():
    # Row 7 is evicted after iteration 2 and prefetched again for iteration 3; with P = 1 that
    # fetch is issued when iteration 2 starts, before the write-back: a stale read.
    prefetch = {0: [7], 3: [7]}
    evict = {2: [7], 3: [7]}
    T = 4

    def csr(d):
        ids = [d.get(t, []) for t in range(T)]
        return np.cumsum([0] + [len(i) for i in ids]), np.array(sum(ids, []), dtype=np.int64)

    (po, pi), (eo, ei) = csr(prefetch), csr(evict)
    with pytest.raises(PlanConsistencyError, match=r"row 7 is prefetched for iteration 3.*after iteration 2"):
        assign_slots(po, pi, eo, ei, distance=1, num_slots=2)
    # Prefetched for 4 instead (issued when 3 starts, after 2's write-back): fine.
    prefetch, evict, T = {0: [7], 4: [7]}, {2: [7], 4: [7]}, 5
    (po, pi), (eo, ei) = csr(prefetch), csr(evict)
    slots, peak = assign_slots(po, pi, eo, ei, distance=1, num_slots=2)
    assert slots.tolist() == [0, 1] and peak == 1
    # Evicting a row that is not cached is refused too.
    (po, pi), (eo, ei) = csr({0: [1]}), csr({0: [1], 1: [2]})
    with pytest.raises(PlanConsistencyError, match="evicts row 2, which is not cached"):
        assign_slots(po, pi, eo, ei, distance=1, num_slots=2)


# ---- plan directories ---------------------------------------------------------------------------


def test_plan_directory_round_trip(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr("dlrmflow.engine.planning.planner.ITERATIONS_PER_FILE", 7)
    dataset = make_dataset(tmp_path / "ds", 5, 900, [40, 300, 6], rows_per_file=250)
    config = PlanConfig(16, 8, 3, capacity=None)
    reference = plan_sequential(dataset, config)
    with caplog.at_level(logging.INFO, logger="dlrmflow.engine.phases"):
        summary = make_plan(dataset, config, tmp_path / "plan", chunk_iterations=10)
    # The decisions are a phase: said before the first task ends (CLI: on stderr, with --json too).
    said = [r.getMessage() for r in caplog.records if r.name == "dlrmflow.engine.phases"]
    assert said[0] == "plan: deciding 57 iterations in 6 tasks (6 chunks x 1 table groups) ..."
    assert said[1].startswith("plan: deciding 57 iterations in 6 tasks (6 chunks x 1 table groups): done in ")
    info = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert info == summary
    assert info["counts"]["prefetched_rows"] == len(reference.prefetch_ids) == info["counts"]["evicted_rows"]
    assert info["counts"]["peak_occupancy"] == reference.peak_occupancy == info["num_slots"]
    assert info["counts"]["ids"] == 900 * 3
    assert info["dataset_fingerprint"] == BatchStream(dataset, 16).meta.fingerprint
    assert len(info["files"]) == -(-reference.num_iterations // 7)
    plan = load_plan(tmp_path / "plan", dataset_dir=dataset, batch_size=16, lookahead=8)
    assert plan.config == config and plan.num_iterations == reference.num_iterations
    steps = list(plan.iterations())
    assert [s.t for s in steps] == list(range(reference.num_iterations))
    for step in steps:
        want = reference.iteration(step.t)
        for field in ("prefetch_ids", "prefetch_slots", "evict_ids"):
            got = getattr(step, field)
            assert got.dtype == np.int64 and np.array_equal(got, getattr(want, field))
    assert [s.t for s in plan.iterations(first=20)] == list(range(20, reference.num_iterations))


def test_load_plan_refuses_other_dataset_batch_size_or_window(tmp_path):
    dataset = make_dataset(tmp_path / "ds", 6, 300, [20, 9])
    other = make_dataset(tmp_path / "other", 7, 300, [20, 9])
    make_plan(dataset, PlanConfig(10, 4, 2), tmp_path / "plan")
    load_plan(tmp_path / "plan", dataset_dir=dataset, batch_size=10, lookahead=4, prefetch_distance=2)
    with pytest.raises(PlanMismatchError, match="another dataset"):
        load_plan(tmp_path / "plan", dataset_dir=other)
    with pytest.raises(PlanMismatchError, match="batch size 10, not 12"):
        load_plan(tmp_path / "plan", dataset_dir=dataset, batch_size=12)
    with pytest.raises(PlanMismatchError, match="lookahead window 4, not 200"):
        load_plan(tmp_path / "plan", lookahead=200)
    with pytest.raises(PlanMismatchError, match="prefetch distance 2, not 1"):
        load_plan(tmp_path / "plan", prefetch_distance=1)


def test_missing_or_incomplete_plan_directories_are_refused(tmp_path):
    dataset = make_dataset(tmp_path / "ds", 8, 300, [20, 9])
    with pytest.raises(PlanError, match="does not exist"):
        load_plan(tmp_path / "nothing")
    make_plan(dataset, PlanConfig(10, 4, 2), tmp_path / "plan")
    part = next((tmp_path / "plan").glob("*.parquet"))
    part.unlink()
    with pytest.raises(PlanError, match=f"incomplete: missing {part.name}"):
        load_plan(tmp_path / "plan")
    (tmp_path / "plan" / "plan.json").unlink()
    with pytest.raises(PlanError, match="plan.json is missing"):
        load_plan(tmp_path / "plan")


def test_interrupted_write_leaves_no_plan_and_keeps_the_old_one(tmp_path, monkeypatch):
    dataset = make_dataset(tmp_path / "ds", 9, 600, [20, 90])
    old = make_plan(dataset, PlanConfig(10, 4, 2), tmp_path / "plan")
    monkeypatch.setattr("dlrmflow.engine.planning.planner.ITERATIONS_PER_FILE", 5)
    real_writer = pq.ParquetWriter
    for output in ("plan", "fresh"):
        calls = []

        class FailingWriter(real_writer):
            def write_table(self, *args, calls=calls, **kwargs):
                calls.append(1)
                if len(calls) == 3:
                    raise KeyboardInterrupt
                return super().write_table(*args, **kwargs)

        monkeypatch.setattr("dlrmflow.engine.planning.planner.pq.ParquetWriter", FailingWriter)
        with pytest.raises(KeyboardInterrupt):
            make_plan(dataset, PlanConfig(10, 6, 2), tmp_path / output)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds", "plan"]  # no temp dir, no "fresh"
    assert load_plan(tmp_path / "plan").info == old


def test_plan_output_refuses_a_directory_that_is_not_a_plan(tmp_path):
    dataset = make_dataset(tmp_path / "ds", 10, 100, [20])
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(PlanError, match="not empty"):
        make_plan(dataset, PlanConfig(10, 4, 1), tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize("min_bits", [1, 3, 10])
def test_id_map_equals_a_dict(monkeypatch, min_bits):
    """Adds (plain, and checked: none added when one is present), lookups (repeats and absent ids), value
    updates and removals, through rebuilds and removed cells taken again, against a dict."""
    monkeypatch.setattr(lookahead.IdMap, "MIN_BITS", min_bits)
    rng = np.random.default_rng(min_bits)
    for high in (40, 5000, 1 << 40):
        m, want, most = lookahead.IdMap(), {}, 0
        for step in range(150):
            new = np.setdiff1d(np.unique(rng.integers(0, high, int(rng.integers(0, 120)))), list(want))
            if step % 2:
                m.add(new.astype(np.int64), new * 3)
            else:
                old = rng.permutation(sorted(want))[:2]
                mixed = rng.permutation(np.concatenate([new, old])).astype(np.int64)
                present = m.add_absent(mixed, mixed * 3)
                assert sorted(mixed[present].tolist()) == sorted(old.tolist())  # then nothing is added
                if len(old):
                    assert m.add_absent(new.astype(np.int64), new * 3).size == 0
            want.update(zip(new.tolist(), (new * 3).tolist(), strict=True))
            most = max(most, len(want))
            asked = rng.integers(0, high, 300).astype(np.int64)
            at, values = m.lookup(asked, -1)
            assert values.tolist() == [want.get(x, -1) for x in asked.tolist()]
            m.set(at, values + 1)  # the absent ids' spare cell takes theirs
            want = {x: v + 1 if x in set(asked.tolist()) else v for x, v in want.items()}
            gone = rng.permutation(sorted(want))[: int(rng.integers(0, len(want) + 1))].astype(np.int64)
            at, values = m.lookup(gone, -1)
            assert (values >= 0).all()
            m.remove(at)
            for x in gone.tolist():
                del want[x]
            ids, values = m.entries()
            assert dict(zip(ids.tolist(), values.tolist(), strict=True)) == want and m.size == len(want)
            assert m.nbytes <= lookahead.IdMap.nbytes_for(most + 120)


def test_a_decision_pass_holds_state_for_the_window_and_keeps_none(tmp_path, monkeypatch):
    """Where the dense array is not the smaller, a pass's last uses are a hash map that follows the ids used
    within the window, whatever the rows of the tables; nothing stays after the pass (no state per thread)."""
    import gc
    import tracemalloc

    dataset = make_dataset(tmp_path / "ds", 5, 4000, [200_000, 300_000, 7], skew=1.4)
    config = PlanConfig(40, 8, 2)
    sizes = []
    real = lookahead.LastUses.used_in

    def used_in(self, lo, hi):
        sizes.append(self.nbytes)
        return real(self, lo, hi)

    monkeypatch.setattr(lookahead.LastUses, "used_in", used_in)
    monkeypatch.setattr(lookahead, "DENSE_LAST_USES_BYTES", 0)  # no allowance: only where smaller
    reference = plan_sequential(dataset, config)
    window_ids = (config.lookahead + 1) * config.batch_size * 3
    dense = 500_007 * 4
    assert sizes[-1] <= lookahead.IdMap.nbytes_for(2 * window_ids) < dense // 4  # the map, sized by the window
    monkeypatch.setattr(lookahead, "DENSE_LAST_USES_BYTES", None)
    gc.collect()
    tracemalloc.start()
    try:
        stream = planner.open_stream(dataset, config)
        before = tracemalloc.get_traced_memory()[0]
        planner.decide_chunk(str(dataset), config, 0, len(stream), 0, 3)
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert after - before < dense // 20  # nothing per row outlives the task
    assert_same_plan(plan_sequential(dataset, config), reference)


def test_slot_replay_holds_the_rows_cached(tmp_path, monkeypatch):
    """The streamed slot replay maps the rows cached at once to their slots, not every embedding row."""
    dataset = make_dataset(tmp_path / "ds", 6, 3000, [100_000, 250_000], skew=1.3)
    config = PlanConfig(30, 6, 2, capacity=120)
    seen = []
    real = planner._SlotReplay.issue

    def issue(self, t, ids, evict_ids):
        slots = real(self, t, ids, evict_ids)
        seen.append((self.cached.size, self.cached.nbytes))
        return slots

    monkeypatch.setattr(planner._SlotReplay, "issue", issue)
    summary = make_plan(dataset, config, tmp_path / "plan")
    assert len(seen) == summary["num_iterations"] and summary["num_slots"] == 120
    assert max(size for size, _ in seen) == summary["counts"]["peak_occupancy"] <= 120
    assert max(nbytes for _, nbytes in seen) <= lookahead.IdMap.nbytes_for(2 * 120)  # 350K rows: 1.4 MB dense


def test_slot_assignment_rejects_a_row_prefetched_or_evicted_twice_at_once():
    po, pi = np.array([0, 2]), np.array([4, 4])
    with pytest.raises(PlanConsistencyError, match="row 4 is prefetched twice for iteration 0"):
        assign_slots(po, pi, np.array([0, 1]), np.array([4]), distance=1, num_slots=2)
    with pytest.raises(PlanConsistencyError, match="iteration 0 evicts row 4 twice"):
        assign_slots(np.array([0, 1]), np.array([4]), np.array([0, 2]), np.array([4, 4]), distance=1, num_slots=2)


# ---- the streamed plan --------------------------------------------------------------------------


def test_streamed_plan_directory_equals_sequential_iteration_by_iteration(tmp_path, monkeypatch):
    """make_plan assembles chunk by chunk and writes file by file: the same prefetches, slots, evictions
    and slot count as the whole-plan reference, over random L, P, capacities, drop_last and chunk sizes
    that cut anywhere (shorter than L, one iteration, a file boundary in the middle of a chunk)."""
    rng = np.random.default_rng(29)
    for i in range(16):  # each case cuts the plan 3-4 ways, and writes and reads them back
        dataset, B, L, P, drop_last = random_case(rng, tmp_path, i)
        batches = stream_sets(dataset, B, drop_last)
        n = len(batches)
        need, peak = capacity_bounds(batches, L, P)
        capacity = [None, need, max(1, (need + peak) // 2), int(rng.integers(need, max(peak, need) + 1))][i % 4]
        config = PlanConfig(B, L, P, capacity, drop_last)
        reference = plan_sequential(dataset, config)
        per_file = int(rng.integers(1, 20))
        monkeypatch.setattr("dlrmflow.engine.planning.planner.ITERATIONS_PER_FILE", per_file)
        for chunk in sorted({1, max(1, L - 1), L + 1, int(rng.integers(1, max(n, 1) + 2))}):
            out = tmp_path / f"plan{i}-{chunk}"
            summary = make_plan(dataset, config, out, chunk_iterations=chunk, table_groups=int(rng.integers(1, 4)))
            assert {k: v for k, v in summary.items() if k != "files"} == reference.summary()
            assert [(f["first"], f["stop"]) for f in summary["files"]] == [
                (a, min(a + per_file, n)) for a in range(0, n, per_file)]
            plan = load_plan(out, dataset_dir=dataset)
            assert plan.num_slots == reference.num_slots
            steps = list(plan.iterations())
            assert [s.t for s in steps] == list(range(n))
            for step in steps:
                want = reference.iteration(step.t)
                for name in ("prefetch_ids", "prefetch_slots", "evict_ids"):
                    assert np.array_equal(getattr(step, name), getattr(want, name)), (i, chunk, step.t, name)
            first, stop = sorted(int(x) for x in rng.integers(0, n + 2, size=2))
            assert [s.t for s in plan.iterations(first, stop)] == list(range(first, min(stop, n)))
            shutil.rmtree(out)


def test_streamed_plan_writes_files_while_chunks_remain_and_reads_only_the_files_of_a_range(tmp_path, monkeypatch):
    monkeypatch.setattr("dlrmflow.engine.planning.planner.ITERATIONS_PER_FILE", 8)
    monkeypatch.setattr("dlrmflow.engine.planning.planner.ROW_GROUP_ITERATIONS", 3)
    dataset = make_dataset(tmp_path / "ds", 11, 2000, [50, 700, 9], rows_per_file=300)
    events = []
    real_take, real_write = planner._Spool.take, planner._DirectorySink.write
    monkeypatch.setattr(planner, "SPOOL_ITERATIONS", 20)  # one piece a chunk
    monkeypatch.setattr(planner._Spool, "take", lambda self, c: events.append(("take", c)) or real_take(self, c))
    monkeypatch.setattr(planner._DirectorySink, "write",
                        lambda self, first, *a: events.append(("write", first)) or real_write(self, first, *a))
    config = PlanConfig(10, 6, 2, capacity=400)
    make_plan(dataset, config, tmp_path / "plan", chunk_iterations=20)
    takes = [e for e in events if e[0] == "take"]
    assert len(takes) == 10
    assert events.index(("write", 0)) < events.index(takes[-1]) < events.index(("write", 192))
    # A chunk is taken only when the assembly reaches L iterations before it: files are written between.
    assert sum(1 for e in events[: events.index(takes[5])] if e[0] == "write") >= 5
    plan = load_plan(tmp_path / "plan")
    read = []  # the iterations of each row group read: a reader holds a row group of the plan at a time
    real_read = pq.ParquetFile.read_row_group

    def read_row_group(self, g, *args, **kwargs):
        table = real_read(self, g, *args, **kwargs)
        read.append(table.column("t").to_pylist())
        return table

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", read_row_group)
    assert [s.t for s in plan.iterations(50, 60)] == list(range(50, 60))
    assert read and all(len(group) <= 3 for group in read)  # row groups of at most 3 iterations
    assert read[0][0] <= 50 < read[0][-1] + 1 and read[-1][0] < 60 <= read[-1][-1] + 1  # none before or after
    assert sorted(t for group in read for t in group) == list(range(read[0][0], read[-1][-1] + 1))
    assert [s.t for s in plan.iterations(0, 200)] == list(range(0, 200))  # the whole plan, group by group
    # The same files as the whole plan written at once (what plans made before streaming hold); row groups
    # of a streamed file end where the pieces do.
    monkeypatch.setattr(planner._DirectorySink, "write", real_write)
    write_plan(plan_sequential(dataset, config), tmp_path / "whole", iterations_per_file=8)
    for name in sorted(p.name for p in (tmp_path / "plan").glob("*.parquet")):
        assert pq.read_table(tmp_path / "plan" / name).equals(pq.read_table(tmp_path / "whole" / name))
    assert json.loads((tmp_path / "plan" / "plan.json").read_text()) == json.loads(
        (tmp_path / "whole" / "plan.json").read_text())
