"""Cache-policy simulators: hand-made traces with known answers, naive references, the MIN bound."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_planner import make_dataset, naive_plan

from dlrmflow.engine.batch_stream import BatchStream, global_ids
from dlrmflow.engine.errors import UserInputError
from dlrmflow.engine.planning.cache_policies import (
    build_trace,
    compare_policies,
    parse_capacity,
    plot_comparison,
    simulate_belady,
    simulate_lru,
    simulate_none,
    simulate_oracle,
    simulate_static,
    trace_from_batches,
)


def trace(*batches, num_rows=10):
    return trace_from_batches(batches, num_rows)


def random_trace(rng: np.random.Generator, max_rows: int = 40):
    num_rows = int(rng.integers(1, max_rows))
    n = int(rng.integers(0, 30))
    weights = np.arange(1, num_rows + 1, dtype=float) ** -float(rng.uniform(0.3, 1.8))
    batches = [rng.choice(num_rows, size=int(rng.integers(1, 8)), p=weights / weights.sum()).tolist()
               for _ in range(n)]
    return trace_from_batches(batches, num_rows), [set(b) for b in batches], batches


# ---- known answers -------------------------------------------------------------------------------


def test_lru_known_answers():
    assert simulate_lru(trace([1], [2], [3], [1]), 2).rows_fetched == 4  # 1 is least recent at t=2
    # t2 needs 4: the LRU row outside {1, 4} is 2; t3 needs 2: the LRU row is then 3.
    r = simulate_lru(trace([1, 2], [3], [1, 4], [2]), 3)
    assert (r.rows_fetched, r.rows_written_back) == (5, 5)
    # Ties (same last use) evict the larger id first: at t1, 9 leaves, 5 stays and hits at t2.
    assert simulate_lru(trace([5, 9], [1], [5]), 2).rows_fetched == 3
    assert simulate_lru(trace([5, 9], [1], [9]), 2).rows_fetched == 4


def test_belady_known_answers():
    assert simulate_belady(trace([1], [2], [3], [1]), 2).rows_fetched == 3  # keeps 1, drops 2
    assert simulate_belady(trace([1, 2], [3], [1, 4], [2]), 3).rows_fetched == 4  # drops 3 (never again)
    assert simulate_belady(trace([1], [2], [3], [1], [2]), 2).rows_fetched == 4


def test_static_and_none_known_answers():
    t = trace([1, 2], [1, 3], [1, 4], [1, 2])  # counts 1:4, 2:2, 3:1, 4:1
    r = simulate_static(t, 3)  # pin {1, 2}: 2 + max 1 streamed row = 3 rows
    assert (r.rows_fetched, r.note) == (2 + 2, "2 rows pinned")
    assert simulate_static(t, 2).rows_fetched == 1 + 4  # pin {1}; 2, 3, 4, 2 stream through
    assert simulate_none(t).rows_fetched == 8 and simulate_none(t).hit_rate == 0.0


def test_oracle_known_answers():
    # L=1: row 1 is kept across the gap of 1, fetched again across the gap of 2.
    assert simulate_oracle(trace([1], [1], [2], [1]), 5, window=1, distance=1).rows_fetched == 3
    assert simulate_oracle(trace([1], [1], [2], [1]), 5, window=2, distance=1).rows_fetched == 2
    # P=1 needs rows of two iterations at once: 2 rows are too few for {1}, {2} then {3}.
    r = simulate_oracle(trace([1], [2], [3]), 1, window=2, distance=1)
    assert r.rows_fetched is None and "iterations 0..1 use 2 rows > capacity 1" in r.note


def test_infeasible_capacity_is_reported_not_hidden():
    t = trace([1, 2, 3], [4])
    for r in (simulate_lru(t, 2), simulate_static(t, 2), simulate_belady(t, 2)):
        assert r.rows_fetched is None and r.hit_rate is None
        assert "iteration 0 uses 3 rows > capacity 2" in r.note


def test_a_sweep_leaves_out_capacities_too_small_for_some_policy_and_compares_the_smallest_that_fits(tmp_path):
    """The pipeline's capacity sweep: with small settings half its capacities were too small for some policy
    (rows empty but for a note; at cache_fraction, the headline read "infeasible"). As a sweep, every row has
    figures; the capacities asked for one by one (``dlrmflow compare-caches``) are reported, infeasible or not."""
    from dlrmflow.engine.planning.cache_policies import build_trace, compare_dataset, smallest_feasible_capacity

    dataset = make_dataset(tmp_path / "d", 3, 400, [20, 60])
    smallest = smallest_feasible_capacity(build_trace(dataset, 20), 4, 2)
    asked = [1, 2, smallest - 1, smallest + 5]
    every = compare_dataset(dataset, 20, asked, window=4, distance=2, embedding_dim=4)
    assert any(r["rows_fetched"] is None for r in every["rows"]) and every["left_out"] == []
    sweep = compare_dataset(dataset, 20, asked, window=4, distance=2, embedding_dim=4, feasible_only=True)
    assert sweep["capacities"] == [smallest, smallest + 5] and sweep["left_out"] == [1, 2, smallest - 1]
    assert sweep["smallest_feasible"] == smallest
    assert all(r["rows_fetched"] is not None for r in sweep["rows"])  # no row empty but for a note
    below = compare_dataset(dataset, 20, [smallest - 1], window=4, distance=2, embedding_dim=4)
    assert any(r["rows_fetched"] is None for r in below["rows"])  # one row fewer and some policy cannot run


# ---- naive references ----------------------------------------------------------------------------


def naive_lru(batches: list[set[int]], capacity: int) -> int:
    last: dict[int, int] = {}
    cache: set[int] = set()
    fetched = 0
    for t, b in enumerate(batches):
        misses = b - cache
        others = sorted(cache - b, key=lambda x: (last[x], -x))  # least recent first, larger id first
        for x in others[: max(0, len(cache) + len(misses) - capacity)]:
            cache.remove(x)
        cache |= b
        fetched += len(misses)
        for x in b:
            last[x] = t
    return fetched


def optimal_fetches(batches: list[set[int]], capacity: int) -> int:
    """The true minimum over every eviction choice (dynamic programming over cache contents)."""
    states = {frozenset(): 0}
    for t, b in enumerate(batches):
        after: dict[frozenset, int] = {}
        for cache, cost in states.items():
            if len(cache | b) > capacity:
                continue
            full = cache | b
            for k in range(len(full) + 1):
                for keep in itertools.combinations(sorted(full), k):
                    nxt = frozenset(keep)
                    nb = batches[t + 1] if t + 1 < len(batches) else set()
                    if len(nxt | nb) <= capacity:
                        c = cost + len(b - cache)
                        if c < after.get(nxt, 1 << 30):
                            after[nxt] = c
        states = after
    return min(states.values())


def test_lru_equals_naive_lru():
    rng = np.random.default_rng(0)
    for _ in range(200):
        t, sets, raw = random_trace(rng)
        capacity = max((len(b) for b in sets), default=1) + int(rng.integers(0, 6))
        r = simulate_lru(t, capacity)
        assert r.rows_fetched == naive_lru(sets, capacity)
        assert r.rows_written_back == r.rows_fetched


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sets(st.integers(0, 4), min_size=1, max_size=3), max_size=7), st.integers(0, 2))
def test_belady_is_the_true_minimum(sets, extra):
    capacity = max((len(b) for b in sets), default=1) + extra
    t = trace_from_batches(sets, 5)
    assert simulate_belady(t, capacity).rows_fetched == (optimal_fetches(sets, capacity) if sets else 0)


def test_oracle_counts_equal_the_naive_planner():
    rng = np.random.default_rng(1)
    for _ in range(150):
        t, sets, raw = random_trace(rng)
        L = int(rng.integers(1, 8))
        P = int(rng.integers(1, L + 1))
        need = max((len(set().union(*sets[u : u + P + 1])) for u in range(len(sets))), default=1)
        capacity = need + int(rng.integers(0, 6))
        naive = naive_plan(sets, L, P, capacity)
        fetched = sum(len(p) for p in naive[0])
        r = simulate_oracle(t, capacity, L, P)
        assert (r.rows_fetched, r.rows_written_back) == (fetched, sum(len(e) for e in naive[2]))


def test_static_equals_a_linear_search_for_the_hot_set():
    rng = np.random.default_rng(2)
    for _ in range(150):
        t, sets, raw = random_trace(rng)
        capacity = max((len(b) for b in sets), default=1) + int(rng.integers(0, 10))
        counts = Counter(x for b in raw for x in b)  # accesses, repeats within a batch included
        order = sorted(counts, key=lambda x: (-counts[x], x))
        best = max(k for k in range(min(len(order), capacity) + 1)
                   if k + max((len(b - set(order[:k])) for b in sets), default=0) <= capacity)
        hot = set(order[:best])
        assert simulate_static(t, capacity).rows_fetched == best + sum(len(b - hot) for b in sets)


def test_min_bounds_every_policy_on_random_traces():
    rng = np.random.default_rng(3)
    for _ in range(150):
        t, sets, raw = random_trace(rng)
        capacity = max((len(set().union(*sets[u : u + 2])) for u in range(len(sets))), default=1)
        capacity += int(rng.integers(0, 8))
        results = {r.policy: r for r in compare_policies(t, [capacity], window=int(rng.integers(1, 10)),
                                                           distance=1)}
        fetched = {p: r.rows_fetched for p, r in results.items()}
        assert fetched["belady"] <= fetched["oracle"] <= fetched["none"]
        assert fetched["belady"] <= fetched["lru"] <= fetched["none"]
        assert fetched["belady"] <= fetched["static"]
        for r in results.values():
            assert r.rows_written_back == r.rows_fetched  # every fetched row goes home exactly once
            assert 0.0 <= r.hit_rate <= 1.0


# ---- trace, table, plot ------------------------------------------------------------------------------


def test_trace_from_a_dataset_matches_the_batch_stream(tmp_path):
    dataset = make_dataset(tmp_path / "ds", 11, 500, [30, 7, 200], rows_per_file=90)
    t = build_trace(dataset, 24)
    stream = BatchStream(dataset, 24)
    ids = [global_ids(b.sparse, stream.offsets) for b in stream]
    assert [b.tolist() for b in t.batches] == [sorted(set(i.ravel().tolist())) for i in ids]
    assert np.array_equal(t.access_counts, np.bincount(np.concatenate([i.ravel() for i in ids]),
                                                       minlength=237))


def test_comparison_table_and_plot(tmp_path):
    dataset = make_dataset(tmp_path / "ds", 12, 800, [40, 300, 6])
    t = build_trace(dataset, 32)
    results = compare_policies(t, [5, 120, 200], window=10, distance=1)
    assert [(r.policy, r.capacity) for r in results][:5] == [
        ("none", None), ("lru", 5), ("static", 5), ("oracle", 5), ("belady", 5)]
    assert all(r.rows_fetched is None for r in results if r.capacity == 5)  # a batch has more rows
    row = next(r for r in results if r.policy == "oracle" and r.capacity == 200).row(embedding_dim=16)
    assert row["bytes_fetched"] == row["rows_fetched"] * 16 * 4
    png = plot_comparison(results, tmp_path / "cache.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_parse_capacity():
    assert parse_capacity("1%", 20000) == 200 and parse_capacity("0.1%", 20000) == 20
    assert parse_capacity("1234", 10) == 1234 and parse_capacity(77, 10) == 77
    for bad in ("abc", "0", "0.0001%", "-5"):
        with pytest.raises(UserInputError):
            parse_capacity(bad, 1000)
