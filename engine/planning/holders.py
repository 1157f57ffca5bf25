"""Which trainers need a cached row: the holders LRPP runs on, and the memory they save.

With W trainers, each training its slice of the global batch (trainer ``w``: rows ``w*B/W .. (w+1)*B/W - 1``),
a row the plan caches for one *lifetime* (prefetched for iteration ``f``, evicted after ``e``, or still
cached when the run ends) is read only by the trainers whose slices use it at some iteration of
``f .. e``: its *holders*. A trainer holds only the rows it is a holder of (docs/trainers.md), not every
cached row: the difference is the memory the holders save.

:func:`holder_counts` replays a plan over the batches in one pass and counts, per trainer, the rows it
holds as the prefetch worker places them (fetched for ``t`` when ``t``'s exchange runs, taken out once
iteration ``e``'s evictions are, before the fetch for ``e + P + 1``: the count
:attr:`~dlrmflow.engine.training.prefetch_state.PrefetchState.peak_held` reports), under either rule. A
lifetime's holders are known only at its eviction, so the pass keeps, per row, the trainers that used
it so far in its current lifetime (a W-bit mask), and per iteration the rows that start and end there.

The LRPP cache runs on the holders: :func:`write_lifetime_holders` stores every lifetime's mask, in the
plan's prefetch order, in a run's directory (:class:`LifetimeHolders`, memory-mapped by each trainer),
with each trainer's peak, the size of its cache.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAX_TRAINERS = 63  # one bit per trainer in an int64 mask


@dataclass
class HolderCounts:
    """Per trainer, rows held over the iterations ``0 .. n-1`` (as the prefetch worker places them)."""

    size: int
    every_row: np.ndarray  # [n]: every trainer holds every cached row (the rule without holders)
    holders_only: np.ndarray  # [W, n]: trainer w holds the rows it is a holder of (the LRPP cache's rule)
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
        """Trainers per prefetched row (W when every trainer holds every row)."""
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
                  iterations: int, always: int = 0,
                  masks_out: np.ndarray | None = None,
                  on_slices: Callable[[int, np.ndarray, np.ndarray], None] | None = None) -> HolderCounts:
    """Replay the plan ``steps`` (each with ``t``, ``prefetch_ids``, ``evict_ids``, in iteration order) over
    ``batches`` (iteration t's global ids ``[B, T]``) for ``iterations`` iterations, W = ``size`` trainers and
    prefetch distance ``distance`` (see the module docstring).

    ``always``: trainers (a mask) that hold every cached row whatever they use (trainer 0 when it alone
    talks to coded servers, or writes checkpoints). ``masks_out``: an array as long as the plan's
    prefetches of iterations ``0 .. iterations-1``, in plan order, that receives each lifetime's holders.
    ``on_slices(t, union, masks)``: called with each batch's :func:`slice_masks`."""
    live = _Lifetimes()  # the rows cached now: their lifetimes' users so far, starts and prefetch indices
    adds = np.zeros((size, iterations), dtype=np.int64)  # rows starting at t, per holder
    removes = np.zeros((size, iterations), dtype=np.int64)  # rows ending after t, per holder
    fetched = np.zeros(iterations, dtype=np.int64)
    evicted = np.zeros(iterations, dtype=np.int64)
    lifetimes = holders = 0

    def end(ids: np.ndarray, t: int | None) -> None:
        nonlocal holders
        mask, start, position = live.end(ids)
        if masks_out is not None:
            masks_out[position] = mask | always
        for s in np.unique(start):
            counts = _popcounts(mask[start == s] | always, size)
            adds[:, s] += counts
            holders += int(counts.sum())
            if t is not None:
                removes[:, t] += counts

    t = -1
    for step, ids in zip(steps, batches, strict=False):
        t = step.t
        if t >= iterations:
            break
        prefetch = np.asarray(step.prefetch_ids, dtype=np.int64)
        evict = np.asarray(step.evict_ids, dtype=np.int64)
        if live.cached(prefetch).any():
            raise ValueError(f"iteration {t}: the plan prefetches a row that is still cached")
        live.begin(prefetch, t, np.arange(lifetimes, lifetimes + len(prefetch)))
        union, users = slice_masks(ids, size)
        if on_slices is not None:
            on_slices(t, union, users)
        if not live.cached(union).all():
            raise ValueError(f"iteration {t}: the batch reads a row the plan has not cached (another dataset?)")
        live.add_users(union, users)
        if not live.cached(evict).all():
            raise ValueError(f"iteration {t}: the plan evicts a row that is not cached")
        fetched[t], evicted[t] = len(prefetch), len(evict)
        lifetimes += len(prefetch)  # after the positions above: the count of prefetches before this one
        end(evict, t)
    if t + 1 < iterations:
        raise ValueError(f"the plan or the batches end at iteration {t + 1}, before {iterations}")
    if masks_out is not None and lifetimes != len(masks_out):
        raise ValueError(f"the plan prefetches {lifetimes} rows in {iterations} iterations, not {len(masks_out)}")
    end(live.ids.copy(), None)  # cached at the end: held to the end

    def held(added: np.ndarray, removed: np.ndarray) -> np.ndarray:
        # Before the fetch for t the evictions of 0 .. t-P-1 are out: held(t) = adds(0..t) - removes(0..t-P-1).
        out = np.cumsum(added, axis=-1)
        gone = np.cumsum(removed, axis=-1)
        out[..., distance + 1:] -= gone[..., :iterations - distance - 1]
        return out

    return HolderCounts(size, held(fetched, evicted), held(adds, removes), lifetimes, holders)


class _Lifetimes:
    """The lifetimes in progress, one per row cached now: the row's users so far (a mask of trainers), the
    iteration its lifetime started and its prefetch's index in the plan. Sorted by id, sized by the cache."""

    def __init__(self) -> None:
        self.ids = np.zeros(0, dtype=np.int64)
        self.mask = np.zeros(0, dtype=np.int64)
        self.start = np.zeros(0, dtype=np.int64)
        self.position = np.zeros(0, dtype=np.int64)

    def _find(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if not len(self.ids):
            return np.zeros(len(ids), dtype=np.int64), np.zeros(len(ids), dtype=bool)
        pos = np.minimum(np.searchsorted(self.ids, ids), len(self.ids) - 1)
        return pos, self.ids[pos] == ids

    def cached(self, ids: np.ndarray) -> np.ndarray:
        """Per id: whether its lifetime is in progress."""
        return self._find(ids)[1]

    def begin(self, ids: np.ndarray, t: int, positions: np.ndarray) -> None:
        """Lifetimes of ``ids`` (none in progress) start at ``t``, no users yet."""
        order = np.argsort(ids, kind="stable")
        ids, positions = ids[order], positions[order]
        at = np.searchsorted(self.ids, ids)
        self.ids = np.insert(self.ids, at, ids)
        self.mask = np.insert(self.mask, at, 0)
        self.start = np.insert(self.start, at, t)
        self.position = np.insert(self.position, at, positions)

    def add_users(self, ids: np.ndarray, users: np.ndarray) -> None:
        """``ids`` (distinct, all in progress) are used by the trainers of ``users``."""
        self.mask[self._find(ids)[0]] |= users

    def end(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The lifetimes of ``ids`` (all in progress) end: their users, starts and prefetch indices, in the
        order of ``ids``."""
        pos = self._find(ids)[0]
        out = self.mask[pos], self.start[pos], self.position[pos]
        keep = np.ones(len(self.ids), dtype=bool)
        keep[pos] = False
        self.ids, self.mask, self.start, self.position = (a[keep] for a in (self.ids, self.mask, self.start,
                                                                           self.position))
        return out


HOLDERS_FILE = "holders.json"


def mask_dtype(size: int) -> np.dtype:
    """The smallest unsigned integer with a bit per trainer."""
    for dtype in (np.uint8, np.uint16, np.uint32, np.uint64):
        if size <= np.iinfo(dtype).bits:
            return np.dtype(dtype)
    raise ValueError(f"trainers must be 1..{MAX_TRAINERS}, got {size}")


@dataclass
class LifetimeHolders:
    """Every cached lifetime's holders for a run of W trainers: ``masks[offsets[t]:offsets[t + 1]]`` are the
    holders (bit ``w``: trainer w) of the rows the plan prefetches for iteration ``t``, in the plan's order;
    ``peaks[w]``: the most rows trainer w holds at once (its cache's rows)."""

    size: int
    offsets: np.ndarray
    masks: np.ndarray
    peaks: list[int]

    def of(self, t: int) -> np.ndarray:
        """The holders of iteration ``t``'s prefetches, as int64 masks."""
        return self.masks[self.offsets[t]:self.offsets[t + 1]].astype(np.int64)


def write_lifetime_holders(directory: str | Path, steps: Callable[[], Iterable], batches: Iterable[np.ndarray], *,
                           size: int, distance: int, iterations: int, always: int = 0,
                           on_slices: Callable[[int, np.ndarray, np.ndarray], None] | None = None) -> LifetimeHolders:
    """Replay the plan (``steps()`` yields its iterations from 0; called twice: the first pass counts the
    prefetches) over ``batches`` as :func:`holder_counts` does and store every lifetime's holders in
    ``directory`` (``masks.npy``, written through a memory map, ``offsets.npy``, ``holders.json``)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    counts = np.zeros(iterations, dtype=np.int64)
    for step in steps():
        if step.t >= iterations:
            break
        counts[step.t] = len(step.prefetch_ids)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    masks = np.lib.format.open_memmap(directory / "masks.npy", mode="w+", dtype=mask_dtype(size),
                                      shape=(int(offsets[-1]),))
    result = holder_counts(steps(), batches, size=size, distance=distance,
                           iterations=iterations, always=always, masks_out=masks, on_slices=on_slices)
    masks.flush()
    del masks
    np.save(directory / "offsets.npy", offsets)
    (directory / HOLDERS_FILE).write_text(json.dumps(
        {"trainers": size, "iterations": iterations, "peaks": result.peak_holders_only,
         "peak_every_row": result.peak_every_row, "mean_holders": result.mean_holders}, indent=1) + "\n")
    return load_lifetime_holders(directory)


def load_lifetime_holders(directory: str | Path) -> LifetimeHolders:
    """The holders :func:`write_lifetime_holders` stored (the masks memory-mapped, read-only)."""
    directory = Path(directory)
    info = json.loads((directory / HOLDERS_FILE).read_text())
    return LifetimeHolders(info["trainers"], np.load(directory / "offsets.npy"),
                           np.load(directory / "masks.npy", mmap_mode="r"), info["peaks"])
