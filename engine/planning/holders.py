"""Which trainers need a cached row: the memory Bagpipe's LRPP saves, measured on a plan before it is built.

With W trainers, each training its slice of the global batch (trainer ``w``: rows ``w*B/W .. (w+1)*B/W - 1``),
a row the plan caches for one *lifetime* (prefetched for iteration ``f``, evicted after ``e``, or still
cached when the run ends) is read only by the trainers whose slices use it at some iteration of
``f .. e``: its *holders*. Today every trainer holds every cached row (docs/trainers.md); with Bagpipe's
rule a trainer would hold only the rows it is a holder of.

:func:`holder_counts` replays a plan over the batches in one pass and counts, per trainer, the rows it
holds as the prefetch worker places them (fetched for ``t`` when ``t``'s exchange runs, taken out once
iteration ``e``'s evictions are, before the fetch for ``e + P + 1``: the count
:attr:`~dlrmflow.engine.training.prefetch_state.PrefetchState.peak_held` reports), under either rule. A
lifetime's holders are known only at its eviction, so the pass keeps, per row, the trainers that used
it so far in its current lifetime (a W-bit mask), and per iteration the rows that start and end there.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

MAX_TRAINERS = 63  # one bit per trainer in an int64 mask


@dataclass
class HolderCounts:
    """Per trainer, rows held over the iterations ``0 .. n-1`` (as the prefetch worker places them)."""

    size: int
    every_row: np.ndarray  # [n]: every trainer holds every cached row (today's LRPP)
    holders_only: np.ndarray  # [W, n]: trainer w holds the rows it is a holder of (Bagpipe's rule)
    lifetimes: int  # lifetimes counted (prefetches)
    holders: int  # their holders, summed over lifetimes

    @property
    def peak_every_row(self) -> int:
        return int(self.every_row.max(initial=0))

    @property
    def peak_holders_only(self) -> list[int]:
        return [int(row.max(initial=0)) for row in self.holders_only]

    @property
    def mean_holders(self) -> float:
        """Trainers per prefetched row under Bagpipe's rule (W today)."""
        return self.holders / self.lifetimes if self.lifetimes else 0.0


def slice_masks(ids: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """``ids`` ``[B, T]`` (global ids of one global batch): its distinct ids, sorted, and per id the mask of
    the trainers (bit ``w``) whose slice uses it."""
    if not 1 <= size <= MAX_TRAINERS:
        raise ValueError(f"trainers must be 1..{MAX_TRAINERS}, got {size}")
    rows = ids.shape[0] // size
    if rows * size != ids.shape[0]:
        raise ValueError(f"a batch of {ids.shape[0]} rows does not split into {size} equal slices")
    union, inverse = np.unique(ids, return_inverse=True)
    inverse = inverse.reshape(ids.shape)
    masks = np.zeros(len(union), dtype=np.int64)
    for w in range(size):
        used = np.zeros(len(union), dtype=bool)
        used[inverse[w * rows:(w + 1) * rows]] = True
        masks[used] |= np.int64(1) << w
    return union, masks


def _popcounts(masks: np.ndarray, size: int) -> np.ndarray:
    """``[W]``: how many of ``masks`` have bit w set."""
    return np.array([np.count_nonzero(masks & (np.int64(1) << w)) for w in range(size)], dtype=np.int64)


def holder_counts(steps: Iterable, batches: Iterable[np.ndarray], *, size: int, distance: int,
                  total_rows: int, iterations: int) -> HolderCounts:
    """Replay the plan ``steps`` (each with ``t``, ``prefetch_ids``, ``evict_ids``, in iteration order) over
    ``batches`` (iteration t's global ids ``[B, T]``) for ``iterations`` iterations, W = ``size`` trainers and
    prefetch distance ``distance`` (see the module docstring)."""
    mask = np.zeros(total_rows, dtype=np.int64)  # per cached row: its current lifetime's users so far
    start = np.full(total_rows, -1, dtype=np.int64)  # per cached row: the iteration its lifetime starts
    adds = np.zeros((size, iterations), dtype=np.int64)  # rows starting at t, per holder
    removes = np.zeros((size, iterations), dtype=np.int64)  # rows ending after t, per holder
    fetched = np.zeros(iterations, dtype=np.int64)
    evicted = np.zeros(iterations, dtype=np.int64)
    lifetimes = holders = 0

    def end(ids: np.ndarray, t: int | None) -> None:
        nonlocal holders
        for s in np.unique(start[ids]):
            ending = ids[start[ids] == s]
            counts = _popcounts(mask[ending], size)
            adds[:, s] += counts
            holders += int(counts.sum())
            if t is not None:
                removes[:, t] += counts
        mask[ids], start[ids] = 0, -1

    t = -1
    for step, ids in zip(steps, batches, strict=False):
        t = step.t
        if t >= iterations:
            break
        prefetch = np.asarray(step.prefetch_ids, dtype=np.int64)
        evict = np.asarray(step.evict_ids, dtype=np.int64)
        if (start[prefetch] >= 0).any():
            raise ValueError(f"iteration {t}: the plan prefetches a row that is still cached")
        start[prefetch], mask[prefetch] = t, 0
        union, users = slice_masks(ids, size)
        if (start[union] < 0).any():
            raise ValueError(f"iteration {t}: the batch reads a row the plan has not cached (another dataset?)")
        mask[union] |= users
        if (start[evict] < 0).any():
            raise ValueError(f"iteration {t}: the plan evicts a row that is not cached")
        fetched[t], evicted[t] = len(prefetch), len(evict)
        lifetimes += len(prefetch)
        end(evict, t)
    if t + 1 < iterations:
        raise ValueError(f"the plan or the batches end at iteration {t + 1}, before {iterations}")
    end(np.flatnonzero(start >= 0), None)  # cached at the end: held to the end

    def held(added: np.ndarray, removed: np.ndarray) -> np.ndarray:
        # Before the fetch for t the evictions of 0 .. t-P-1 are out: held(t) = adds(0..t) - removes(0..t-P-1).
        out = np.cumsum(added, axis=-1)
        gone = np.cumsum(removed, axis=-1)
        out[..., distance + 1:] -= gone[..., :iterations - distance - 1]
        return out

    return HolderCounts(size, held(fetched, evicted), held(adds, removes), lifetimes, holders)
