"""Bagpipe's holders (engine/planning/holders.py): per trainer, the rows a plan's lifetimes need, against a
brute-force replay on random traces and plans made by the lookahead rule."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from dlrmflow.engine.planning.holders import holder_counts, load_lifetime_holders, slice_masks, write_lifetime_holders


def lookahead_plan(batches: list[np.ndarray], lookahead: int) -> list[SimpleNamespace]:
    """The rule without a capacity: a row is prefetched for t when its previous use is more than L ago (or
    none), and evicted after t when its next use is more than L later (or none)."""
    uses = [np.unique(b) for b in batches]
    last: dict[int, int] = {}
    steps = [SimpleNamespace(t=t, prefetch_ids=[], evict_ids=[]) for t in range(len(batches))]
    for t, ids in enumerate(uses):
        for x in ids.tolist():
            if x not in last or t - last[x] > lookahead:
                steps[t].prefetch_ids.append(x)
                if x in last:
                    steps[last[x]].evict_ids.append(x)
            last[x] = t
    for x, t in last.items():
        if t + lookahead < len(batches) - 1:  # not used again within the run
            steps[t].evict_ids.append(x)
    return steps


def brute_force(batches, steps, size: int, distance: int) -> tuple[list[int], list[list[int]]]:
    """Per iteration, rows held by every trainer today and by each trainer under the holders rule."""
    n, rows = len(batches), batches[0].shape[0] // size
    lives = []  # (row, first, last iteration cached)
    open_: dict[int, int] = {}
    for step in steps:
        for x in step.prefetch_ids:
            open_[x] = step.t
        for x in step.evict_ids:
            lives.append((x, open_.pop(x), step.t))
    lives += [(x, f, None) for x, f in open_.items()]
    every, per = [0] * n, [[0] * n for _ in range(size)]
    for x, f, e in lives:
        span = range(f, n if e is None else e + 1)
        users = {w for u in span for w in range(size) if x in batches[u][w * rows:(w + 1) * rows]}
        for t in range(n):
            if f <= t and (e is None or t - distance - 1 < e):
                every[t] += 1
                for w in users:
                    per[w][t] += 1
    return every, per


@pytest.mark.parametrize("seed", range(12))
def test_holder_counts_equal_a_brute_force_replay(seed):
    rng = np.random.default_rng(seed)
    size, n = int(rng.integers(1, 5)), int(rng.integers(3, 25))
    batch = size * int(rng.integers(1, 5))
    total = int(rng.integers(8, 60))
    zipf = rng.zipf(1.4, size=(n, batch, 2)) % total  # skewed, so rows repeat within and across batches
    batches = [b for b in zipf]
    lookahead, distance = int(rng.integers(1, 6)), int(rng.integers(1, 4))
    steps = lookahead_plan(batches, lookahead)
    counts = holder_counts(steps, batches, size=size, distance=distance, iterations=n)
    every, per = brute_force(batches, steps, size, distance)
    assert counts.every_row.tolist() == every
    assert counts.holders_only.tolist() == per
    assert counts.lifetimes == sum(len(s.prefetch_ids) for s in steps)
    if size == 1:  # one trainer holds what the plan caches
        assert counts.holders_only[0].tolist() == every and counts.mean_holders == 1.0


def test_slice_masks_name_the_trainers_of_each_id():
    ids = np.array([[5, 1], [5, 2], [7, 1], [7, 7]])  # trainer 0: rows 0-1, trainer 1: rows 2-3
    union, masks = slice_masks(ids, 2)
    assert union.tolist() == [1, 2, 5, 7] and masks.tolist() == [0b11, 0b01, 0b01, 0b10]
    with pytest.raises(ValueError, match="does not split into 3 equal slices"):
        slice_masks(ids, 3)


def test_a_plan_for_other_batches_is_refused():
    batches = [np.array([[1], [2]]), np.array([[3], [4]])]
    steps = lookahead_plan([np.array([[1], [2]]), np.array([[1], [2]])], 4)
    with pytest.raises(ValueError, match="iteration 1: the batch reads a row the plan has not cached"):
        holder_counts(steps, batches, size=2, distance=1, iterations=2)


@pytest.mark.parametrize("seed", range(8))
def test_the_stored_holders_of_each_lifetime_are_the_trainers_that_use_it(tmp_path, seed):
    """What an LRPP run reads (write_lifetime_holders): per prefetch, in plan order, the trainers whose slices
    use the row while it is cached (and ``always``'s), and per trainer the peak of what it holds."""
    rng = np.random.default_rng(100 + seed)
    size, n = int(rng.integers(2, 5)), int(rng.integers(3, 20))
    batch = size * int(rng.integers(1, 4))
    total = int(rng.integers(8, 50))
    batches = [b for b in rng.zipf(1.4, size=(n, batch, 2)) % total]
    steps = lookahead_plan(batches, int(rng.integers(1, 5)))
    distance, always = int(rng.integers(1, 3)), int(rng.integers(0, 2))
    seen = []
    stored = write_lifetime_holders(tmp_path, lambda: iter(steps), iter(batches), size=size, distance=distance,
                                    iterations=n, always=always,
                                    on_slices=lambda t, union, masks: seen.append((t, union, masks)))
    assert stored.peaks == load_lifetime_holders(tmp_path).peaks
    rows = batch // size
    for step in steps:
        for x, mask in zip(step.prefetch_ids, stored.of(step.t).tolist(), strict=True):
            end = next((s.t for s in steps[step.t:] if x in s.evict_ids), n - 1)
            users = {w for u in range(step.t, end + 1) for w in range(size)
                     if x in batches[u][w * rows:(w + 1) * rows]}
            assert mask == sum(1 << w for w in users) | always, (step.t, x)
    counts = holder_counts(steps, batches, size=size, distance=distance, iterations=n,
                           always=always)
    assert stored.peaks == counts.peak_holders_only
    assert [t for t, *_ in seen] == list(range(n))
    assert all(np.array_equal(u, slice_masks(b, size)[0]) and np.array_equal(m, slice_masks(b, size)[1])
               for (_, u, m), b in zip(seen, batches, strict=True))
