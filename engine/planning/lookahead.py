"""The array passes of the oracle cacher (Bagpipe's lookahead planning), on global embedding ids.

Vocabulary. Iteration ``t`` uses the set ``U_t`` of global ids of its batch. The *gap* of a use
``(x, t)`` is ``t - p``, ``p`` being x's previous use (infinite when there is none). With lookahead
window ``L`` a row stays cached across a gap ``<= L`` and is written back across a longer one, so
x is prefetched for ``t`` iff the gap is ``> L``, and evicted after ``t`` iff its next use is after
``t + L`` or missing. With prefetch distance ``P`` the fetch for ``t`` is issued when iteration
``t - P`` starts, so while iteration ``u`` computes the cache holds every row used in ``u .. u+P``
plus the rows kept across a gap that spans ``u``.

Capacity. Keeping x across a gap ``(p, t)`` with ``P + 2 <= t - p <= L`` costs a slot exactly at
times ``p+1 .. t-P-1`` (outside them the row is in the cache anyway); shorter gaps cost nothing and
are always kept. Those *candidate intervals* ``[s, e] = [p+1, t-P-1]`` are what a capacity bound
trades: :func:`farthest_first_drops` scans time forward and, where the cache would overflow, drops
the kept rows whose next use is farthest (Belady within the window). That greedy keeps the most
gaps, so it fetches the fewest rows; with ``P = 0`` and an unbounded window it is Belady's MIN.

Everything works on dense per-id arrays indexed by global id (tables own disjoint, contiguous id
ranges), so a batch costs one gather and one scatter instead of hashing or a per-batch sort.

Why these rules are correct, and how ``L`` relates to Bagpipe's ``lookahead_value``: docs/planner.md.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow.parquet as pq

from dlrmflow.engine.batch_stream import BatchStream
from dlrmflow.engine.errors import UserInputError

INT32_MAX = 2**31 - 1


BLOCK_ROWS = 1 << 16  # rows decoded at a time: small enough to stay in cache-friendly, reusable buffers


def _id_blocks(
    stream: BatchStream, row_lo: int, row_hi: int, tables: range, reuse_buffer: bool
) -> Iterator[tuple[int, np.ndarray]]:
    """``(first row, ids)`` blocks covering rows ``row_lo .. row_hi-1``, ``ids`` of shape (tables, rows).

    A block ends at a batch boundary where it can (so that few batches straddle two blocks).
    """
    meta = stream.meta
    columns = [meta.sparse_columns[k] for k in tables]
    offsets = [np.int64(stream.offsets[k]) for k in tables]
    batch = stream.batch_size
    most = max(BLOCK_ROWS // batch, 1) * batch
    buffer = np.empty(len(columns) * most, dtype=np.intp) if reuse_buffer else None  # NumPy indexes with intp
    group_start = 0
    for part in meta.files:
        if group_start >= row_hi:
            break
        if group_start + part.rows <= row_lo:
            group_start += part.rows
            continue
        parquet = pq.ParquetFile(stream.dataset_dir / part.name)
        for g in range(parquet.num_row_groups):
            group_end = group_start + parquet.metadata.row_group(g).num_rows
            lo, hi = max(row_lo, group_start), min(row_hi, group_end)
            base, group_start = group_start, group_end
            if lo >= hi:
                continue
            # Decoding a row group in record batches keeps Arrow's buffers small and reused.
            pieces = parquet.iter_batches(batch_size=most, row_groups=[g], columns=columns, use_threads=False)
            piece_lo = base
            for piece in pieces:
                piece_hi = piece_lo + piece.num_rows
                cols = [piece.column(j).to_numpy() for j in range(len(columns))]
                pos = max(lo, piece_lo)
                while pos < min(hi, piece_hi):
                    end = min(hi, piece_hi, pos + most)
                    if end < hi and end - (end - stream.start_row) % batch > pos:
                        end -= (end - stream.start_row) % batch  # end at a batch boundary where one follows pos
                    shape = (len(columns), end - pos)
                    block = (buffer[: shape[0] * shape[1]].reshape(shape) if buffer is not None
                             else np.empty(shape, dtype=np.intp))
                    for j, col in enumerate(cols):
                        np.add(col[pos - piece_lo : end - piece_lo], offsets[j], out=block[j], casting="unsafe")
                    yield pos, block
                    pos = end
                piece_lo = piece_hi
                if piece_lo >= hi:
                    break


def iter_id_batches(
    stream: BatchStream, first: int, stop: int, tables: range | None = None, *, reuse_buffer: bool = False
) -> Iterator[tuple[int, np.ndarray]]:
    """Global ids of batches ``first .. stop-1`` of ``stream``, as ``(len(tables), rows)`` arrays.

    Per batch these are exactly ``global_ids(batch.sparse, stream.offsets)[:, tables].T`` of the
    same :class:`BatchStream` (a test checks it); this reader only skips what the planner does not
    need: dense columns and re-reading a file per block. Table-major layout keeps each table's ids
    together (better locality for the gathers). Batches are views into blocks of ~64K rows; only a
    batch that straddles two row groups is copied. With ``reuse_buffer`` every block is decoded
    into the same buffer (no fresh allocation and page faults per block): a batch is then only
    valid until the next one is requested.
    """
    tables = range(len(stream.meta.sparse_columns)) if tables is None else tables
    stop = min(stop, len(stream))
    if first >= stop:
        return
    t = first
    batch_lo, batch_hi = stream.batch_rows(t)
    head: np.ndarray | None = None  # the first rows of batch t, from the previous row group
    for lo, block in _id_blocks(stream, batch_lo, stream.batch_rows(stop - 1)[1], tables, reuse_buffer):
        hi = lo + block.shape[1]
        if head is not None:  # finish the batch that started in the previous row group
            head = np.concatenate([head, block[:, : batch_hi - lo]], axis=1)
            if batch_hi > hi:
                continue
            yield t, head
            head = None
            t += 1
            if t < stop:
                batch_lo, batch_hi = stream.batch_rows(t)
        while t < stop and batch_hi <= hi:
            yield t, block[:, batch_lo - lo : batch_hi - lo]
            t += 1
            if t < stop:
                batch_lo, batch_hi = stream.batch_rows(t)
        if t < stop and batch_lo < hi:
            head = block[:, batch_lo - lo :].copy()
    if t != stop:
        raise RuntimeError(f"the dataset ended at batch {t}, before batch {stop}")


class LastUseTable:
    """A dense ``last use`` array over all global ids, reused across calls in one thread.

    Values are ``epoch + t``; every call starts a new epoch above anything stored before, so
    stale entries look like "never used" (their gap exceeds any window) and the 100+ MB array
    is never re-filled between chunks.
    """

    _local = threading.local()

    def __init__(self, num_rows: int) -> None:
        self.last = np.zeros(num_rows, dtype=np.int32)
        self.high = 0  # largest value ever stored

    @classmethod
    def for_thread(cls, num_rows: int) -> LastUseTable:
        table = getattr(cls._local, "table", None)
        if table is None or len(table.last) != num_rows:
            table = cls._local.table = cls(num_rows)
        return table

    def begin(self, num_iterations: int, window: int) -> int:
        """The epoch for a pass over ``num_iterations`` iterations with lookahead ``window``."""
        epoch = self.high + window + 2
        if epoch + num_iterations >= INT32_MAX:
            self.last[:] = 0
            epoch = window + 2
        if epoch + num_iterations >= INT32_MAX:
            raise ValueError(f"{num_iterations} iterations with window {window} overflow the last-use table")
        self.high = epoch + num_iterations
        return epoch


@dataclass
class RangeDecisions:
    """Decisions for iterations ``first .. stop-1`` (CSR: ``counts[i]`` ids for iteration first+i)."""

    first: int
    stop: int
    prefetch_counts: np.ndarray  # int64 [stop-first]
    prefetch_ids: np.ndarray  # int64, sorted within each iteration
    evict_counts: np.ndarray
    evict_ids: np.ndarray
    cand_ids: np.ndarray  # candidate intervals (see module doc): id, first and last time of the slot cost
    cand_start: np.ndarray
    cand_end: np.ndarray


def decide_range(
    batches: Iterable[tuple[int, np.ndarray]],
    *,
    first: int,
    stop: int,
    num_iterations: int,
    window: int,
    distance: int,
    candidates: bool,
    num_rows: int,
    id_range: tuple[int, int] | None = None,
) -> RangeDecisions:
    """Unbounded-cache decisions for iterations ``first .. stop-1`` (and capacity candidates).

    ``batches`` must yield ``(t, ids)`` for every ``t`` in ``max(0, first-window) ..
    min(num_iterations, stop+window) - 1`` in order: the halo before gives each row's previous
    use, the halo after its next use. Ids may repeat within a batch and must lie in ``id_range``
    (default: all rows).

    An eviction after ``p`` is found where it is decided: at the row's next use ``t`` when
    ``t - p > window`` (a miss whose previous use is ``p``), or at the end for rows whose last
    use in the pass is ``p`` (no use follows within the window, or at all).
    """
    table = LastUseTable.for_thread(num_rows)
    last = table.last
    epoch = table.begin(num_iterations, window)
    lo_time, hi_time = epoch + first, epoch + stop  # stored values of this range's iterations
    prefetch: list[np.ndarray] = []
    evict_keys: list[np.ndarray] = []  # p * num_rows + x: evict x after p
    cand_ids: list[np.ndarray] = []
    cand_prev: list[np.ndarray] = []
    cand_time: list[int] = []

    expected = max(0, first - window)
    scratch = _Scratch()
    for t, ids in batches:
        if t != expected:
            raise ValueError(f"decide_range got batch {t} where {expected} was expected")
        expected += 1
        now = epoch + t
        if t < first:  # halo before: only last-use times matter
            last[ids] = now
            continue
        prev = np.take(last, ids, out=scratch.get("prev", ids.shape, np.int32))
        last[ids] = now
        miss = np.less(prev, now - window, out=scratch.get("miss", ids.shape, np.bool_))
        x, where = np.unique(ids[miss], return_index=True)
        p = prev[miss][where]
        closes = (p >= lo_time) & (p < hi_time)  # the previous use is ours: evict after it
        evict_keys.append((p[closes] - epoch).astype(np.int64) * num_rows + x[closes])
        if t >= stop:  # halo after: only evictions of our iterations matter
            continue
        prefetch.append(x)
        if candidates:
            keep = np.greater_equal(prev, now - window, out=scratch.get("keep", ids.shape, np.bool_))
            keep &= np.less_equal(prev, now - distance - 2, out=scratch.get("keep2", ids.shape, np.bool_))
            x, where = np.unique(ids[keep], return_index=True)
            cand_ids.append(x)
            cand_prev.append(prev[keep][where])
            cand_time.append(t)
    if expected != min(num_iterations, stop + window):
        raise ValueError(f"decide_range stopped at batch {expected}, expected {min(num_iterations, stop + window)}")

    id_lo, id_hi = id_range if id_range is not None else (0, num_rows)
    tail = last[id_lo:id_hi]
    left = np.flatnonzero((tail >= lo_time) & (tail < hi_time))  # last use in the pass is ours
    evict_keys.append((tail[left] - epoch).astype(np.int64) * num_rows + (left + id_lo))
    keys = np.sort(np.concatenate(evict_keys))
    evict_times, evict_ids = np.divmod(keys, num_rows)

    prefetch_counts = np.fromiter((len(a) for a in prefetch), dtype=np.int64, count=len(prefetch))
    prefetch_ids = np.concatenate(prefetch).astype(np.int64) if prefetch else np.zeros(0, np.int64)
    evict_counts = np.bincount(evict_times - first, minlength=stop - first).astype(np.int64)
    if cand_ids:
        sizes = [len(a) for a in cand_ids]
        ids_all = np.concatenate(cand_ids).astype(np.int64, copy=False)
        start = np.concatenate(cand_prev).astype(np.int64) - epoch + 1
        end = np.repeat(np.asarray(cand_time, np.int64) - distance - 1, sizes)
    else:
        ids_all = start = end = np.zeros(0, np.int64)
    return RangeDecisions(first, stop, prefetch_counts, prefetch_ids, evict_counts, evict_ids, ids_all, start, end)


class _Scratch:
    """Per-batch work arrays, allocated once per pass (fresh large temporaries cost page faults)."""

    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: type) -> np.ndarray:
        size = int(np.prod(shape))
        a = self.arrays.get(name)
        if a is None or a.size < size:
            a = self.arrays[name] = np.empty(size, dtype=dtype)
        return a[:size].reshape(shape)


def occupancy(prefetch_counts: np.ndarray, evict_counts: np.ndarray, distance: int) -> np.ndarray:
    """Rows in the cache while each iteration computes, counting fetches already issued.

    A row prefetched for ``t`` holds its slot from the start of ``t - distance`` (clipped to 0);
    a row evicted after ``v`` frees it for iteration ``v + 1``.
    """
    n = len(prefetch_counts)
    delta = np.zeros(n + 1, dtype=np.int64)
    np.add.at(delta, np.maximum(np.arange(n) - distance, 0), prefetch_counts)
    delta[1:] -= evict_counts
    return np.cumsum(delta[:n])


def coverage(start: np.ndarray, end: np.ndarray, n: int) -> np.ndarray:
    """How many intervals ``[start, end]`` contain each time ``0 .. n-1``."""
    delta = np.bincount(start, minlength=n + 1)[: n + 1] - np.bincount(end + 1, minlength=n + 1)[: n + 1]
    return np.cumsum(delta[:n])


def farthest_first_drops(over: np.ndarray, start: np.ndarray, end: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Which candidate intervals to give up so that no time is over capacity (a bool mask).

    ``over[u]`` is the occupancy at ``u`` minus the capacity when every candidate is kept.
    Scanning ``u`` forward, while ``u`` is over capacity drop, among the kept intervals that
    contain ``u``, the one ending last (ties: the larger id). The caller guarantees that dropping
    every candidate is enough.
    """
    n = len(over)
    dropped = np.zeros(len(start), dtype=bool)
    hot = over > 0
    if not hot.any():
        return dropped
    # Only an interval that contains an over-capacity time can ever be dropped.
    hot_before = np.concatenate([[0], np.cumsum(hot)])
    relevant = np.nonzero(hot_before[end + 1] - hot_before[start] > 0)[0]
    order = relevant[np.lexsort((ids[relevant], end[relevant], start[relevant]))]
    by_start = np.searchsorted(start[order], np.arange(n + 1))
    buckets: dict[int, list[np.ndarray]] = {}  # end -> kept intervals (indices), each piece sorted by id
    kept_by_end = np.zeros(n + 1, dtype=np.int64)
    dropped_by_end = np.zeros(n + 1, dtype=np.int64)
    dropped_live = 0  # dropped intervals that still contain u (end >= u)
    top = 0  # largest end holding kept intervals
    last_hot = int(np.nonzero(hot)[0][-1])
    for u in range(last_hot + 1):
        if u:
            dropped_live -= int(dropped_by_end[u - 1])
            buckets.pop(u - 1, None)
        group = order[by_start[u] : by_start[u + 1]]
        if len(group):
            ends = end[group]
            cuts = np.flatnonzero(np.diff(ends)) + 1
            for piece in np.split(group, cuts):
                e = int(end[piece[0]])
                buckets.setdefault(e, []).append(piece)
                kept_by_end[e] += len(piece)
            top = max(top, int(ends[-1]))
        excess = int(over[u]) - dropped_live
        if excess <= 0:
            continue
        live_ends = np.flatnonzero(kept_by_end[u : top + 1]) + u
        for e in live_ends[::-1].tolist():
            pieces = buckets[e]
            count = int(kept_by_end[e])
            if count <= excess:
                for piece in pieces:
                    dropped[piece] = True
                take = count
                del buckets[e]
            else:
                members = np.concatenate(pieces)
                members = members[np.argsort(ids[members], kind="stable")]
                dropped[members[count - excess :]] = True
                buckets[e] = [members[: count - excess]]
                take = excess
            kept_by_end[e] -= take
            dropped_by_end[e] += take
            dropped_live += take
            excess -= take
            if excess == 0:
                break
        if excess > 0:
            raise RuntimeError(f"time {u} stays over capacity after dropping every kept row")
    return dropped


class PlanConsistencyError(UserInputError):
    """A plan would read a stale row or evict a row it never fetched (see :func:`assign_slots`)."""


def assign_slots(
    prefetch_offsets: np.ndarray,
    prefetch_ids: np.ndarray,
    evict_offsets: np.ndarray,
    evict_ids: np.ndarray,
    *,
    distance: int,
    num_slots: int,
    num_rows: int,
) -> tuple[np.ndarray, int]:
    """Cache slots for every prefetch, replaying the trainer's timing; returns (slots, peak rows).

    Step ``u`` (iteration ``u`` starts): the evictions after ``u-1`` are written back and their
    slots join the back of a free queue; then the fetches for ``u + distance`` take slots from
    its front (before step 1, the fetches for ``0 .. distance``). Prefetching a row that is
    still cached (its write-back comes later) is a stale read and raises PlanConsistencyError.
    """
    n = len(prefetch_offsets) - 1
    slot_plus_one = _slot_map(num_rows, num_slots)  # 0 = not cached; all zero again after a complete plan
    free = np.empty(num_slots + len(prefetch_ids), dtype=np.int64)
    free[:num_slots] = np.arange(num_slots)
    head, tail = 0, num_slots
    slots = np.empty(len(prefetch_ids), dtype=np.int64)
    peak = 0

    def issue(t: int) -> None:
        nonlocal head
        a, b = int(prefetch_offsets[t]), int(prefetch_offsets[t + 1])
        ids = prefetch_ids[a:b]
        cached = slot_plus_one[ids] != 0
        if cached.any():
            x = int(ids[cached][0])
            later = np.nonzero(evict_ids == x)[0]
            after = [int(np.searchsorted(evict_offsets, i, side="right") - 1) for i in later]
            after = [v for v in after if v >= t - distance - 1]
            raise PlanConsistencyError(
                f"row {x} is prefetched for iteration {t} (issued when iteration {t - distance} starts) "
                f"while it is still cached"
                + (f": it is written back only after iteration {after[0]}" if after else "")
                + f"; with prefetch distance {distance} that fetch would read a stale row"
            )
        if tail - head < b - a:
            raise RuntimeError(f"iteration {t}: {b - a} prefetches but only {tail - head} free slots")
        slots[a:b] = free[head : head + b - a]
        slot_plus_one[ids] = slots[a:b] + 1
        head += b - a

    def release(v: int) -> None:
        nonlocal tail
        ids = evict_ids[int(evict_offsets[v]) : int(evict_offsets[v + 1])]
        held = slot_plus_one[ids] - 1
        if (held < 0).any():
            raise PlanConsistencyError(f"iteration {v} evicts row {int(ids[held < 0][0])}, which is not cached")
        slot_plus_one[ids] = 0
        free[tail : tail + len(ids)] = held
        tail += len(ids)

    try:
        for t in range(min(distance, n - 1) + 1):
            issue(t)
        peak = num_slots - (tail - head) if n else 0
        for u in range(1, n):
            release(u - 1)
            if u + distance < n:
                issue(u + distance)
            peak = max(peak, num_slots - (tail - head))
        if n:
            release(n - 1)
        if tail - head != num_slots:
            raise PlanConsistencyError(f"{num_slots - (tail - head)} rows stay cached after the last iteration")
    except BaseException:
        _slot_maps.__dict__.pop("map", None)  # not all zero any more
        raise
    return slots, peak


_slot_maps = threading.local()


def _slot_map(num_rows: int, num_slots: int) -> np.ndarray:
    # Reused across plans in a thread: touching a fresh 100+ MB array costs more than the pass.
    dtype = np.dtype(np.int32) if num_slots < INT32_MAX else np.dtype(np.int64)
    m = getattr(_slot_maps, "map", None)
    if m is None or len(m) != num_rows or m.dtype != dtype:
        m = _slot_maps.map = np.zeros(num_rows, dtype=dtype)
    return m


def slot_map(num_rows: int, num_slots: int) -> np.ndarray:
    """This thread's id -> slot + 1 map (0: not cached), all zero; :func:`forget_slot_map` after a failed replay."""
    return _slot_map(num_rows, num_slots)


def forget_slot_map() -> None:
    """Drop this thread's slot map (a replay that failed leaves it not all zero)."""
    _slot_maps.__dict__.pop("map", None)
