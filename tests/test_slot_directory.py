"""The cache directory (id -> slot, slot -> id) in memory sized by the cache: random sequences of placements and
removals answer exactly as a dense id-indexed table would."""

from __future__ import annotations

import numpy as np
import pytest

from dlrmflow.engine.training.slot_directory import SlotDirectory


class DenseDirectory:
    """The reference: one entry per id of the table."""

    def __init__(self, total_rows: int, num_slots: int) -> None:
        self.slot_of = np.full(total_rows, -1, dtype=np.int64)
        self.owner = np.full(num_slots, -1, dtype=np.int64)
        self.held = self.peak = 0

    def place(self, ids: np.ndarray, slots: np.ndarray) -> None:
        self.held += int(np.count_nonzero(self.slot_of[ids] < 0))
        self.peak = max(self.peak, self.held)
        self.slot_of[ids] = slots
        self.owner[slots] = ids

    def remove(self, ids: np.ndarray) -> np.ndarray:
        slots = self.slot_of[ids]
        self.held -= int(np.count_nonzero(slots >= 0))
        self.slot_of[ids] = -1
        self.owner[slots[slots >= 0]] = -1
        return slots


@pytest.mark.parametrize("seed", range(20))
def test_random_placements_and_removals_answer_as_a_dense_table(seed):
    rng = np.random.default_rng(seed)
    total, num_slots = int(rng.integers(1, 400)), int(rng.integers(1, 60))
    dense, sparse = DenseDirectory(total, num_slots), SlotDirectory(num_slots)
    for _ in range(200):
        free = np.flatnonzero(dense.owner < 0)
        if len(free) and rng.random() < 0.55:
            count = int(rng.integers(1, len(free) + 1))
            uncached = np.flatnonzero(dense.slot_of < 0)
            count = min(count, len(uncached))
            ids = rng.choice(uncached, count, replace=False)
            slots = rng.choice(free, count, replace=False)
            dense.place(ids, slots)
            sparse.place(ids, slots)
        else:
            cached = np.flatnonzero(dense.slot_of >= 0)
            # Some of the ids removed are not cached: they answer -1 and change nothing.
            ids = np.unique(np.concatenate([rng.choice(cached, int(rng.integers(0, len(cached) + 1)), replace=False),
                                            rng.integers(0, total, int(rng.integers(0, 3)))])) if len(cached) else \
                rng.integers(0, total, 2)
            assert np.array_equal(sparse.remove(ids), dense.remove(ids))
        probe = rng.integers(0, total, 50)
        assert np.array_equal(sparse.lookup(probe), dense.slot_of[probe])
        assert np.array_equal(sparse.owner, dense.owner)
        assert (sparse.held, sparse.peak) == (dense.held, dense.peak)
        ids, slots = sparse.cached()
        assert np.array_equal(ids, np.flatnonzero(dense.slot_of >= 0)) and np.array_equal(slots, dense.slot_of[ids])


def test_a_cached_id_placed_again_moves_to_its_new_slot():
    directory = SlotDirectory(4)
    directory.place(np.array([7, 3]), np.array([0, 1]))
    directory.place(np.array([3]), np.array([2]))
    assert directory.lookup([3, 7, 5]).tolist() == [2, 0, -1] and directory.held == 2


def test_the_directory_holds_nothing_per_row_of_the_table():
    """Its arrays grow with the rows cached, whatever the ids' range."""
    directory = SlotDirectory(8)
    directory.place(np.array([10**12, 5, 10**9]), np.array([0, 1, 2]))
    ids, slots = directory.cached()
    assert ids.tolist() == [5, 10**9, 10**12] and slots.tolist() == [1, 2, 0]
    assert directory.lookup([10**9, 6]).tolist() == [2, -1]
