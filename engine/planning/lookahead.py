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

State per id is kept for the ids in play only: those used within the window in a decision pass (or a
dense array over the pass's id range while that is small, for speed), those cached in the slot replay. An
:class:`IdMap`, a hash table vectorized over a batch, holds them, so what a pass or a replay holds follows
the window or the cache, not the embedding rows of the tables, and nothing outlives it.

Why these rules are correct, and how ``L`` relates to Bagpipe's ``lookahead_value``: docs/planner.md.
"""

from __future__ import annotations

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


# The cells past its home that an IdMap probe reads at once: 8 in its first round (most runs end there), then
# 64, so that every id needs few rounds however long its run. Spans are laid out (offset, id): numpy's
# elementwise loops then run along the ids, not along a handful of offsets.
_OFFSETS = np.arange(1, 65)[:, None]
_FIRST_SPAN = 8


def _first(where: np.ndarray) -> np.ndarray:
    """Per column of a (span, ids) mask, the first row where it holds (the span's length where none does)."""
    return np.where(where, _OFFSETS[: len(where)] - 1, len(where)).min(axis=0)


class IdMap:
    """Global ids -> int64 values in a hash table with linear probing, each operation vectorized over an array
    of ids: the state of rows in play (used within the lookahead window, or cached) without an array over
    every embedding row.

    A cell is a (key, value) pair side by side, so that one gather reads both. A key is an id (ids are >= 0),
    ``EMPTY`` (never used: a probe stops there) or ``GONE`` (its entry was removed: a probe passes it). A
    table is built with at most a quarter of its cells holding entries and rebuilt when half are in use
    (entries and removed ones): short probes, and a rebuild per at least a quarter of the cells added. So it
    takes 16 bytes a cell and fewer than 8 cells per entry, counting those being added (:meth:`nbytes_for`).

    :meth:`lookup` answers with cell positions, valid until the next :meth:`add`; an absent id gets the
    position of a spare cell past the table, which no probe reaches, so that a caller can scatter values for
    a whole batch without first masking the absent ids out.
    """

    EMPTY = -1
    GONE = -2
    MIN_BITS = 10  # the smallest table: 1024 cells, 16 KiB
    CELL_BYTES = 16
    _MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)  # 2^64 / golden ratio (Fibonacci hashing): spreads runs of ids

    def __init__(self, expected: int = 0) -> None:
        self._allocate(self._bits_for(expected))

    @classmethod
    def of(cls, ids: np.ndarray, values: np.ndarray, extra: int = 0) -> IdMap:
        """A map of distinct ``ids`` to ``values``, with room for ``extra`` more entries before a rebuild."""
        m = cls(len(ids) + extra)
        m.add(np.asarray(ids, dtype=np.int64), values)
        return m

    @classmethod
    def _bits_for(cls, entries: int) -> int:
        return max(cls.MIN_BITS, (4 * entries - 1).bit_length() if entries else 0)

    @classmethod
    def nbytes_for(cls, entries: int) -> int:
        """The bytes of a table built for ``entries`` entries."""
        return cls.CELL_BYTES * ((1 << cls._bits_for(entries)) + 1)

    def _allocate(self, bits: int) -> None:
        self._bits, self._mask = bits, (1 << bits) - 1
        table = np.full(((1 << bits) + 1, 2), self.EMPTY, dtype=np.int64)
        table[-1, 0] = self.GONE  # the spare cell: its key matches no id
        self._table = table
        self._keys, self._values = table[:, 0], table[:, 1]
        self._cells = table.view(np.complex128).reshape(-1)  # a cell as one 16-byte item
        self.nowhere = 1 << bits  # the spare cell's position
        self._used = 0  # at least the cells that hold an entry or held one (not EMPTY), the spare cell aside
        self.size = 0  # entries

    @property
    def nbytes(self) -> int:
        return self._table.nbytes

    def _home(self, ids: np.ndarray) -> np.ndarray:
        cell = np.asarray(ids, dtype=np.int64).view(np.uint64) * self._MULTIPLIER
        cell >>= np.uint64(64 - self._bits)
        return cell.view(np.int64)

    def lookup(self, ids: np.ndarray, absent: int) -> tuple[np.ndarray, np.ndarray]:
        """``(positions, values)`` of ``ids`` (int64, 1-D, repeats allowed); an absent id's value is ``absent``."""
        at = self._home(ids)
        pair = np.take(self._cells, at).view(np.int64).reshape(-1, 2)
        keys, values = pair[:, 0], pair[:, 1]  # views of a fresh array: the caller may keep them
        missed = np.flatnonzero(keys != ids)
        if missed.size:
            values[missed] = absent
            probe = missed[keys[missed] != self.EMPTY]  # a collision: the id may sit further on
            base = at[probe]
            at[missed] = self.nowhere
            width = _FIRST_SPAN
            while probe.size:
                span = (base + _OFFSETS[:width]) & self._mask
                pair = np.take(self._cells, span).view(np.int64).reshape(*span.shape, 2)
                hit = pair[..., 0] == ids[probe]
                end = _first(hit | (pair[..., 0] == self.EMPTY))
                ended = end < width
                cols = np.flatnonzero(ended)
                cols = cols[hit[end[cols], cols]]
                at[probe[cols]] = span[end[cols], cols]
                values[probe[cols]] = pair[end[cols], cols, 1]
                probe, base = probe[~ended], base[~ended] + width
                width = len(_OFFSETS)
        return at, values

    def set(self, at: np.ndarray, values: np.ndarray | int) -> None:
        """Values at positions from :meth:`lookup` (the absent ids' spare cell takes them harmlessly)."""
        self._values[at] = values

    def add(self, ids: np.ndarray, values: np.ndarray | int) -> None:
        """New entries: ``ids`` (int64) distinct and absent, as a lookup has just shown."""
        if self.full(len(ids)):
            self._rebuild(len(ids))
        values = np.broadcast_to(np.asarray(values, dtype=np.int64), ids.shape)
        home = self._home(ids)
        keys = self._keys[home]
        left = self._claim(np.flatnonzero(keys < 0), home, keys, ids, values)  # most find their home free
        if left.size:
            self._place(ids[left], values[left], home[left] + 1)
        self.size += len(ids)

    def add_absent(self, ids: np.ndarray, values: np.ndarray | int) -> np.ndarray:
        """Add ``ids`` (int64, distinct) unless some are present: returns the indices into ``ids`` of those
        present (then nothing is added), else an empty array. One probe per id checks and places it."""
        if self.full(len(ids)):
            self._rebuild(len(ids))
        home = self._home(ids)
        keys = self._keys[home]
        present = [np.flatnonzero(keys == ids)]
        target, target_keys = home, keys.copy()  # the first free cell of each id's probe (home, when free)
        probe = np.flatnonzero((keys != self.EMPTY) & (keys != ids))  # its probe goes on past home
        base = home[probe]
        width = _FIRST_SPAN
        while probe.size:
            span = (base + _OFFSETS[:width]) & self._mask
            keys = self._keys[span]
            hit = keys == ids[probe]
            end = _first(hit | (keys == self.EMPTY))
            ended = end < width
            cols = np.flatnonzero(ended)
            present.append(probe[cols[hit[end[cols], cols]]])
            free = _first(keys < 0)  # a GONE cell, or the EMPTY one that ends the probe
            cols = np.flatnonzero((target_keys[probe] >= 0) & (free < width))  # no free cell before this span
            target[probe[cols]] = span[free[cols], cols]
            target_keys[probe[cols]] = keys[free[cols], cols]
            probe, base = probe[~ended], base[~ended] + width
            width = len(_OFFSETS)
        present = np.concatenate(present)
        if present.size:
            return present
        values = np.broadcast_to(np.asarray(values, dtype=np.int64), ids.shape)
        left = self._claim(np.arange(len(ids)), target, target_keys, ids, values)
        if left.size:  # several chose one cell: the others take the next free cells on
            self._place(ids[left], values[left], target[left] + 1)
        self.size += len(ids)
        return present

    def full(self, incoming: int) -> bool:
        """Whether adding ``incoming`` entries would rebuild the table."""
        return self._used + incoming > (self._mask + 1) // 2

    def _rebuild(self, incoming: int) -> None:
        """The entries again, in a table with room for ``incoming`` more."""
        kept_ids, kept_values = self.entries()
        self._allocate(self._bits_for(len(kept_ids) + incoming))
        self.add(kept_ids, kept_values)

    def _place(self, ids: np.ndarray, values: np.ndarray, base: np.ndarray) -> None:
        """Put absent ``ids`` in the first free cells from ``base`` on, a span of cells at a time."""
        todo = np.arange(len(ids))
        width = _FIRST_SPAN
        while todo.size:
            span = (base + _OFFSETS[:width] - 1) & self._mask
            keys = self._keys[span]
            free = _first(keys < 0)
            cols = np.arange(len(todo))
            at = np.minimum(free, width - 1)
            chosen, keys = span[at, cols], keys[at, cols]
            rows = np.flatnonzero(free < width)
            base += width  # no free cell in the span: on past it
            base[rows] = chosen[rows] + 1  # a free cell lost to another id: on from there
            left = self._claim(rows, chosen, keys, ids[todo], values[todo])
            todo, base = todo[left], base[left]
            width = len(_OFFSETS)

    def _claim(self, rows: np.ndarray, cells: np.ndarray, keys: np.ndarray, ids: np.ndarray,
               values: np.ndarray) -> np.ndarray:
        """Ids ``rows`` take their free ``cells`` (whose keys are ``keys``); where several chose one cell, one
        of them gets it. Returns the positions of the ids (of all ``ids``) that still need a cell."""
        where = cells[rows]
        self._keys[where] = ids[rows]
        won = self._keys[where] == ids[rows]
        took = rows[won]
        self._values[where[won]] = values[took]
        self._used += int(np.count_nonzero(keys[took] == self.EMPTY))  # a GONE cell taken again was counted
        left = np.ones(len(ids), dtype=bool)
        left[took] = False
        return np.flatnonzero(left)

    def remove(self, at: np.ndarray) -> None:
        """Remove the entries at positions from :meth:`lookup` of present ids, each position once."""
        self._keys[at] = self.GONE
        self.size -= len(at)
        # A removed cell before an EMPTY one ends no probe that would not end there anyway: it becomes EMPTY
        # (shorter probes, rarer rebuilds). Such cells are next to their entries: this costs little.
        ends = at[self._keys[(at + 1) & self._mask] == self.EMPTY]
        self._keys[ends] = self.EMPTY
        self._used -= len(ends)

    def entries(self) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, values)`` of every entry, in no particular order."""
        live = np.flatnonzero(self._keys[:-1] >= 0)
        return self._keys[live], self._values[live]


# A decision pass holds its last uses in a dense array over its id range (a gather and a scatter per batch,
# two to three times faster than the IdMap) when that array takes at most this many bytes, or no more than the
# map would; None: never (tests run the map alone). The array lives as long as the pass.
DENSE_LAST_USES_BYTES: int | None = 64 << 20


class LastUses:
    """Each id's last use in one :func:`decide_range` pass, stored as ``t + shift`` (0: no use yet), with
    ``shift > L + 1`` so that "no use" reads as a gap longer than any window.

    Only the ids used within the window matter: an older use is a gap ``> L``, a miss, whatever its time.
    So the state is an :class:`IdMap` of the ids used lately; when it needs room, the entries older than
    the window leave it (:meth:`make_room` hands them back, for their write-backs) and it is rebuilt for
    those that stay: fewer than 8 cells of 16 bytes per id used in the last ``L + 1`` iterations, plus a
    batch's. A dense array over the pass's id range (4 bytes a row) holds the times instead where it takes
    at most ``DENSE_LAST_USES_BYTES`` or no more than the map, for speed. Either lives as long as the pass:
    no task keeps anything per row after it ends, and a pass over more rows than that allowance holds state
    sized by its window.
    """

    def __init__(self, id_lo: int, id_hi: int, highest: int) -> None:
        self.id_lo, self.rows = id_lo, id_hi - id_lo
        self.dtype = np.dtype(np.int32) if highest < INT32_MAX else np.dtype(np.int64)
        self.map: IdMap | None = IdMap()
        self.dense: np.ndarray | None = None
        self._at: np.ndarray | None = None  # where the batch just looked up sits
        self._ids = self._prev = None
        if self._dense_fits(0):
            self._go_dense(np.zeros(0, np.int64), np.zeros(0, np.int64))

    def _dense_fits(self, entries: int) -> bool:
        """Whether the dense array should hold the times rather than a map of ``entries`` entries."""
        if DENSE_LAST_USES_BYTES is None:
            return False
        return self.rows * self.dtype.itemsize <= max(DENSE_LAST_USES_BYTES, IdMap.nbytes_for(entries))

    def _go_dense(self, ids: np.ndarray, last: np.ndarray) -> None:
        self.dense = np.zeros(self.rows, dtype=self.dtype)  # pages are zeroed as they are first touched
        self.dense[ids - self.id_lo] = last
        self.map = None

    @property
    def nbytes(self) -> int:
        return self.dense.nbytes if self.dense is not None else self.map.nbytes

    def make_room(self, incoming: int, expired_below: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Room for ``incoming`` ids (a batch); returns the entries dropped for it, ``(ids, stored times)``, all
        below ``expired_below`` (None when none was dropped)."""
        if self.map is None or not self.map.full(incoming):
            return None
        ids, last = self.map.entries()
        old = last < expired_below
        if self._dense_fits(len(ids) - int(np.count_nonzero(old)) + incoming):
            self._go_dense(ids[~old], last[~old])
        else:
            self.map = IdMap.of(ids[~old], last[~old], extra=incoming)
        return ids[old], last[old]

    def previous(self, ids: np.ndarray) -> np.ndarray:
        """The stored last use of each of ``ids`` (any shape; 0: none); :meth:`store` follows."""
        if self.dense is not None:
            self._at = ids - self.id_lo if self.id_lo else ids
            return self.dense[self._at]
        self._ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        self._at, self._prev = self.map.lookup(self._ids, 0)
        return self._prev.reshape(ids.shape)

    def store(self, now: int, new: np.ndarray | None = None) -> None:
        """The batch just looked up is used at ``now``; ``new``: its distinct ids that had no stored use, when
        the caller has them (else found here, when needed)."""
        if self.dense is not None:
            self.dense[self._at] = now
            return
        self.map.set(self._at, now)
        if new is None:
            new = np.unique(self._ids[self._prev == 0])
        self.map.add(np.asarray(new, dtype=np.int64), now)

    def used_in(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, stored times)`` of the ids whose stored last use lies in ``lo .. hi-1``."""
        if self.dense is not None:
            parts = [np.zeros(0, np.int64)]
            for a in range(0, self.rows, BLOCK_ROWS):  # a block at a time: no mask as long as the array
                block = self.dense[a : a + BLOCK_ROWS]
                parts.append(np.flatnonzero((block >= lo) & (block < hi)) + a)
            rows = np.concatenate(parts)
            return rows + self.id_lo, self.dense[rows]
        ids, last = self.map.entries()
        mine = (last >= lo) & (last < hi)
        return ids[mine], last[mine]


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
    ``t - p > window`` (a miss whose previous use is ``p``), when the row's last use leaves the state
    (:meth:`LastUses.make_room`: no use came within the window), or at the end for rows whose last use
    in the pass is ``p`` (no use follows within the window, or at all). The state lives as long as the
    call (:class:`LastUses`).
    """
    id_lo, id_hi = id_range if id_range is not None else (0, num_rows)
    shift = window + 2  # a stored time is t + shift: 0 ("no use") is a gap above any window
    lo_time, hi_time = shift + first, shift + stop  # stored values of this range's iterations
    uses = LastUses(id_lo, id_hi, shift + num_iterations)
    prefetch: list[np.ndarray] = []
    evict_keys: list[np.ndarray] = []  # p * num_rows + x: evict x after p

    def evict_after_own(x: np.ndarray, p: np.ndarray) -> None:
        """Rows ``x`` whose use ``p`` (stored) is followed by none within the window: ours when ``p`` is."""
        closes = (p >= lo_time) & (p < hi_time)
        evict_keys.append((p[closes] - shift).astype(np.int64) * num_rows + x[closes])

    cand_ids: list[np.ndarray] = []
    cand_prev: list[np.ndarray] = []
    cand_time: list[int] = []

    expected = max(0, first - window)
    scratch = _Scratch()
    for t, ids in batches:
        if t != expected:
            raise ValueError(f"decide_range got batch {t} where {expected} was expected")
        expected += 1
        now = shift + t
        expired = uses.make_room(ids.size, now - window)
        if expired is not None:
            evict_after_own(*expired)
        prev = uses.previous(ids)
        if t < first:  # halo before: only last-use times matter
            uses.store(now)
            continue
        miss = np.less(prev, now - window, out=scratch.get("miss", ids.shape, np.bool_))
        x, where = np.unique(ids[miss], return_index=True)
        p = prev[miss][where]
        uses.store(now, x[p == 0])
        evict_after_own(x, p)  # the previous use is ours: evict after it
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

    evict_after_own(*uses.used_in(lo_time, hi_time))  # last use in the pass is ours
    del uses
    keys = np.sort(np.concatenate(evict_keys))
    evict_times, evict_ids = np.divmod(keys, num_rows)

    prefetch_counts = np.fromiter((len(a) for a in prefetch), dtype=np.int64, count=len(prefetch))
    prefetch_ids = np.concatenate(prefetch).astype(np.int64) if prefetch else np.zeros(0, np.int64)
    evict_counts = np.bincount(evict_times - first, minlength=stop - first).astype(np.int64)
    if cand_ids:
        sizes = [len(a) for a in cand_ids]
        ids_all = np.concatenate(cand_ids).astype(np.int64, copy=False)
        start = np.concatenate(cand_prev).astype(np.int64) - shift + 1
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
) -> tuple[np.ndarray, int]:
    """Cache slots for every prefetch, replaying the trainer's timing; returns (slots, peak rows).

    Step ``u`` (iteration ``u`` starts): the evictions after ``u-1`` are written back and their
    slots join the back of a free queue; then the fetches for ``u + distance`` take slots from
    its front (before step 1, the fetches for ``0 .. distance``). Prefetching a row that is
    still cached (its write-back comes later) is a stale read and raises PlanConsistencyError.
    The rows cached map to their slots in an :class:`IdMap`, sized by the rows cached at once.
    """
    n = len(prefetch_offsets) - 1
    cached = IdMap()  # row -> its slot, for the rows fetched and not yet written back
    free = np.empty(num_slots + len(prefetch_ids), dtype=np.int64)
    free[:num_slots] = np.arange(num_slots)
    head, tail = 0, num_slots
    slots = np.empty(len(prefetch_ids), dtype=np.int64)
    peak = 0

    def issue(t: int) -> None:
        nonlocal head
        a, b = int(prefetch_offsets[t]), int(prefetch_offsets[t + 1])
        ids = prefetch_ids[a:b].astype(np.int64, copy=False)
        twice = repeated_id(ids)
        if twice is None and tail - head >= b - a:  # then one probe per id checks and places it
            present = cached.add_absent(ids, free[head : head + b - a])
            if not present.size:
                slots[a:b] = free[head : head + b - a]
                head += b - a
                return
        else:
            present = np.flatnonzero(cached.lookup(ids, -1)[1] >= 0)
        if present.size:
            x = int(ids[present.min()])
            later = np.nonzero(evict_ids == x)[0]
            after = [int(np.searchsorted(evict_offsets, i, side="right") - 1) for i in later]
            after = [v for v in after if v >= t - distance - 1]
            raise PlanConsistencyError(
                f"row {x} is prefetched for iteration {t} (issued when iteration {t - distance} starts) "
                f"while it is still cached"
                + (f": it is written back only after iteration {after[0]}" if after else "")
                + f"; with prefetch distance {distance} that fetch would read a stale row"
            )
        if twice is not None:
            raise PlanConsistencyError(f"row {twice} is prefetched twice for iteration {t}")
        raise RuntimeError(f"iteration {t}: {b - a} prefetches but only {tail - head} free slots")

    def release(v: int) -> None:
        nonlocal tail
        ids = evict_ids[int(evict_offsets[v]) : int(evict_offsets[v + 1])].astype(np.int64, copy=False)
        at, held = cached.lookup(ids, -1)
        if (held < 0).any():
            raise PlanConsistencyError(f"iteration {v} evicts row {int(ids[held < 0][0])}, which is not cached")
        twice = repeated_id(ids)
        if twice is not None:
            raise PlanConsistencyError(f"iteration {v} evicts row {twice} twice")
        cached.remove(at)
        free[tail : tail + len(ids)] = held
        tail += len(ids)

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
    return slots, peak


def repeated_id(ids: np.ndarray) -> int | None:
    """An id that occurs more than once in ``ids``, or None (at once for ids in ascending order, as a plan
    iteration's are)."""
    if len(ids) < 2 or (ids[1:] > ids[:-1]).all():
        return None
    values, counts = np.unique(ids, return_counts=True)
    return int(values[np.argmax(counts > 1)]) if (counts > 1).any() else None
