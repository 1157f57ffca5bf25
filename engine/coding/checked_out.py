"""The trainer's copy of each row as it was fetched: the *old* row of its next write-back, from which
the write-back's parity delta (``old ^ new``) is computed.

Only the rows the trainer holds are kept, and so is their index: an open-addressing hash table from
row id to the row's place in the rows buffer, whose lookups, inserts and removals are vectorized over
a batch of ids (one NumPy pass per probe step). A table sized by the embedding table would make every
trainer grow with the tables (hundreds of millions of rows), where the rows it holds are those of its
cache."""

from __future__ import annotations

import numpy as np

_EMPTY = -1  # a key never used since the index was (re)built: a lookup stops here
_GONE = -2  # a removed key: a lookup goes on past it, an insert may reuse it
_FIBONACCI = np.uint64(0x9E3779B97F4A7C15)  # 2^64 / golden ratio: spreads consecutive ids over the index
_MIN_CAPACITY = 16
_MAX_SLOTS = int(np.iinfo(np.int32).max)  # places in the rows buffer are int32


class _IdIndex:
    """Row id -> int32 value (a place in the rows buffer), by linear probing in a power-of-two table.

    At most half the entries are used (live keys and removed ones together), so every probe sequence
    reaches an empty entry; a rebuild (when that half would be exceeded, or fewer than one entry in eight
    is live) sizes the table to four to eight entries per live key. Memory: 12 bytes per entry, so 24-96
    bytes per live key (16 entries at least)."""

    def __init__(self) -> None:
        self._allocate(_MIN_CAPACITY)

    def _allocate(self, capacity: int) -> None:
        self.keys = np.full(capacity, _EMPTY, dtype=np.int64)
        self.values = np.zeros(capacity, dtype=np.int32)
        self.live = 0
        self.used = 0  # entries that are not _EMPTY: live keys and _GONE ones
        self.shift = np.uint64(64 - (capacity.bit_length() - 1))

    @property
    def nbytes(self) -> int:
        return int(self.keys.nbytes + self.values.nbytes)

    def _home(self, ids: np.ndarray) -> np.ndarray:
        return ((ids.astype(np.uint64) * _FIBONACCI) >> self.shift).astype(np.int64)

    def find(self, ids: np.ndarray) -> np.ndarray:
        """The entry of each of ``ids``, -1 where it is not a live key."""
        mask = len(self.keys) - 1
        found = np.full(len(ids), -1, dtype=np.int64)
        todo = np.arange(len(ids))
        at = self._home(ids)
        while len(todo):
            key = self.keys[at]
            hit = key == ids[todo]
            found[todo[hit]] = at[hit]
            going = ~hit & (key != _EMPTY)
            todo, at = todo[going], (at[going] + 1) & mask
        return found

    def insert(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Add ``ids``, none of them a live key (an id may repeat: its copies share one entry), after
        :meth:`make_room` for them. Returns the entry of each id and the entries added (one per distinct
        id), whose values the caller sets."""
        mask = len(self.keys) - 1
        placed = np.empty(len(ids), dtype=np.int64)
        added = []
        todo = np.arange(len(ids))
        at = self._home(ids)
        while len(todo):
            want = ids[todo]
            key = self.keys[at]
            hit = key == want  # a copy of an id placed earlier in this call
            free = np.flatnonzero(key < 0)
            if len(free):
                # Every id at a free entry writes its key there; the one whose write stays owns it, and so
                # do its copies (they probe in step with it). The others move on.
                entries = at[free]
                self.keys[entries] = want[free]
                won = self.keys[entries] == want[free]
                hit[free[won]] = True
                entries, was_empty = entries[won], key[free[won]] == _EMPTY
                self.values[entries] = np.arange(len(entries), dtype=np.int32)  # marks: one copy per entry
                first = self.values[entries] == np.arange(len(entries), dtype=np.int32)
                added.append(entries[first])
                self.used += int(was_empty[first].sum())
            placed[todo[hit]] = at[hit]
            todo, at = todo[~hit], (at[~hit] + 1) & mask
        added_entries = np.concatenate(added) if added else np.zeros(0, dtype=np.int64)
        self.live += len(added_entries)
        return placed, added_entries

    def remove(self, entries: np.ndarray) -> None:
        """Drop the keys at ``entries`` (distinct live entries)."""
        self.keys[entries] = _GONE
        self.live -= len(entries)
        if len(self.keys) > _MIN_CAPACITY and 8 * self.live < len(self.keys):
            self._rebuild(self.live)

    def make_room(self, adding: int) -> bool:
        """Room for ``adding`` more keys; True when that rebuilt the table (every entry found before moved)."""
        if 2 * (self.used + adding) <= len(self.keys):
            return False
        self._rebuild(self.live + adding)
        return True

    def _rebuild(self, keys: int) -> None:
        """A fresh table of at least four entries per key (``keys`` of them), holding the live keys."""
        live = np.flatnonzero(self.keys >= 0)
        ids, values = self.keys[live], self.values[live]
        self._allocate(max(_MIN_CAPACITY, 1 << max(4 * keys - 1, 1).bit_length()))
        placed, _ = self.insert(ids)
        self.values[placed] = values


class CheckedOutRows:
    """The trainer's copy of each row as it was fetched (the *old* row of its next write-back).

    ``buf`` holds the rows, each at a place of its own until it is taken; ``free`` lists the places not in
    use. The buffer doubles when full and is kept (the trainer's cache refills it). Memory: the rows
    buffer (at most twice the most rows checked out at once) and an index of 24-96 bytes per row
    checked out now; nothing per table row. At most 2^31 - 1 rows checked out at once (int32 places)."""

    def __init__(self, width: int) -> None:
        self.index = _IdIndex()
        self.buf = np.empty((0, width), dtype=np.float32)
        self.free = np.zeros(0, dtype=np.int32)

    def __len__(self) -> int:
        return self.index.live

    @property
    def nbytes(self) -> int:
        return int(self.buf.nbytes + self.free.nbytes + self.index.nbytes)

    def put(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Keep ``rows`` as the rows of ``ids`` (replacing the row of an id already checked out; of an id
        given twice, the later row)."""
        ids = np.asarray(ids, dtype=np.int64)
        entries = self.index.find(ids)
        new = entries < 0
        if new.any():
            if self.index.make_room(int(new.sum())):
                entries = self.index.find(ids)
            placed, added = self.index.insert(ids[new])
            try:
                self.index.values[added] = self._take_places(len(added))
            except RuntimeError:
                self.index.remove(added)
                raise
            entries[new] = placed
        places = self.index.values[entries]
        self.buf.view(np.uint8)[places] = np.ascontiguousarray(rows).view(np.uint8)

    def peek(self, ids: np.ndarray) -> np.ndarray:
        """The rows kept for ``ids``, which stay checked out (RuntimeError for an id that is not)."""
        return self.buf[self.index.values[self._entries(np.asarray(ids, dtype=np.int64))]]

    def take(self, ids: np.ndarray) -> np.ndarray:
        """The rows kept for ``ids``, which are no longer checked out (RuntimeError, with nothing changed,
        for an id that is not)."""
        ids = np.asarray(ids, dtype=np.int64)
        entries = self._entries(ids)
        places = self.index.values[entries]
        rows = self.buf[places]
        # An id given twice is released once: one copy of each entry, found by marking the entries.
        order = np.arange(len(entries), dtype=np.int32)
        self.index.values[entries] = order
        first = self.index.values[entries] == order
        self.free = np.concatenate([self.free, places[first]])
        self.index.remove(entries[first])
        return rows

    def _entries(self, ids: np.ndarray) -> np.ndarray:
        entries = self.index.find(ids)
        if (entries < 0).any():
            raise RuntimeError(f"write-back of row {int(ids[entries < 0][0])}, which was never fetched: "
                               "its parity delta cannot be computed")
        return entries

    def _take_places(self, n: int) -> np.ndarray:
        """``n`` free places in ``buf`` (grown, doubling, when too few are free)."""
        if n > len(self.free):
            start = len(self.buf)
            grow = min(max(n - len(self.free), start), _MAX_SLOTS - start)
            if grow < n - len(self.free):
                raise RuntimeError(f"more than {_MAX_SLOTS:,} rows checked out at once")
            self.buf = np.concatenate([self.buf, np.empty((grow, self.buf.shape[1]), np.float32)])
            self.free = np.concatenate([self.free, np.arange(start, start + grow, dtype=np.int32)])
        places = self.free[len(self.free) - n :]
        self.free = self.free[: len(self.free) - n]
        return places
