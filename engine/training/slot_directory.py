"""Which embedding row sits in which cache slot, in memory sized by the cache, not by the table.

A trainer's cache holds a few of the table's rows; its directory must not hold an entry per row of the
table (Criteo Terabyte has 188M-880M of them). :class:`SlotDirectory` keeps the cached ids sorted beside
their slots (id -> slot by binary search, vectorized) and ``owner`` (slot -> id). Placing or removing a
batch of rows rewrites the sorted arrays once: O(cache) bytes moved per call, a few per iteration.

NumPy only: the prefetch worker's state (:mod:`.prefetch_state`), which imports no torch, uses it too.
"""

from __future__ import annotations

import numpy as np

_NO_IDS = np.zeros(0, dtype=np.int64)


class SlotDirectory:
    """Id -> slot and slot -> id of ``num_slots`` cache slots. Readers ask :meth:`lookup` and read ``owner``
    (-1: a free slot); only :meth:`place` and :meth:`remove` change them. ``held``: rows cached now;
    ``peak``: the most at once."""

    def __init__(self, num_slots: int) -> None:
        self.owner = np.full(num_slots, -1, dtype=np.int64)
        self._ids = _NO_IDS  # the cached ids, sorted
        self._slots = _NO_IDS  # their slots
        self.held = self.peak = 0

    def _find(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per id: its position in the sorted ids (clipped) and whether it is cached."""
        if not len(self._ids):
            return np.zeros(len(ids), dtype=np.int64), np.zeros(len(ids), dtype=bool)
        pos = np.minimum(np.searchsorted(self._ids, ids), len(self._ids) - 1)
        return pos, self._ids[pos] == ids

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """The slot of each of ``ids`` (-1: not cached), a fresh array."""
        ids = np.asarray(ids, dtype=np.int64)
        pos, found = self._find(ids)
        out = np.full(len(ids), -1, dtype=np.int64)
        out[found] = self._slots[pos[found]]
        return out

    def place(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """``ids`` (distinct) now sit in ``slots``: an id already cached moves to its new slot."""
        ids, slots = np.asarray(ids, dtype=np.int64), np.asarray(slots, dtype=np.int64)
        if not len(ids):
            return
        pos, found = self._find(ids)
        self._slots = self._slots.copy() if found.any() else self._slots
        self._slots[pos[found]] = slots[found]
        new = ~found
        if new.any():
            order = np.argsort(ids[new], kind="stable")
            new_ids, new_slots = ids[new][order], slots[new][order]
            at = np.searchsorted(self._ids, new_ids)
            self._ids = np.insert(self._ids, at, new_ids)
            self._slots = np.insert(self._slots, at, new_slots)
        self.held += int(np.count_nonzero(new))
        self.peak = max(self.peak, self.held)
        self.owner[slots] = ids

    def remove(self, ids: np.ndarray) -> np.ndarray:
        """``ids`` leave the cache; returns the slots they had (-1: an id that was not cached)."""
        ids = np.asarray(ids, dtype=np.int64)
        pos, found = self._find(ids)
        slots = np.full(len(ids), -1, dtype=np.int64)
        slots[found] = self._slots[pos[found]]
        if found.any():
            keep = np.ones(len(self._ids), dtype=bool)
            keep[pos[found]] = False
            self._ids, self._slots = self._ids[keep], self._slots[keep]
            self.owner[slots[found]] = -1
        self.held -= int(np.count_nonzero(found))
        return slots

    def cached(self) -> tuple[np.ndarray, np.ndarray]:
        """Every cached id (sorted) and its slot, fresh arrays."""
        return self._ids.copy(), self._slots.copy()

    def cached_ids(self) -> np.ndarray:
        """Every cached id, sorted."""
        return self._ids.copy()
