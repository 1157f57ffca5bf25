"""The trainer's copy of each row as it was fetched: the *old* row of its next write-back, from which
the write-back's parity delta (``old ^ new``) is computed."""

from __future__ import annotations

import numpy as np


class CheckedOutRows:
    """The trainer's copy of each row as it was fetched (the *old* row of its next write-back).

    ``pos`` (a row's place in ``buf``, -1 when not checked out) has one entry per table row, so it is
    int32: 4 bytes per row, where the rows themselves are 20-300 (it bounds ``buf`` to 2^31 rows,
    which are rows in the trainer's cache)."""

    def __init__(self, total_rows: int, width: int) -> None:
        self.pos = np.full(total_rows, -1, dtype=np.int32)
        self.buf = np.empty((0, width), dtype=np.float32)
        self.free = np.zeros(0, dtype=np.int32)

    def __len__(self) -> int:
        return int((self.pos >= 0).sum())

    @property
    def nbytes(self) -> int:
        return int(self.buf.nbytes + self.pos.nbytes)

    def put(self, ids: np.ndarray, rows: np.ndarray) -> None:
        pos = self.pos[ids]
        new = pos < 0
        n_new = int(new.sum())
        if n_new > len(self.free):
            start = len(self.buf)
            grow = min(max(n_new - len(self.free), start), np.iinfo(np.int32).max - start)
            if grow < n_new - len(self.free):
                raise RuntimeError(f"more than {np.iinfo(np.int32).max:,} rows checked out at once")
            self.buf = np.concatenate([self.buf, np.empty((grow, self.buf.shape[1]), np.float32)])
            self.free = np.concatenate([self.free, np.arange(start, start + grow, dtype=np.int32)])
        pos[new] = self.free[-n_new:] if n_new else pos[new]
        if n_new:
            self.free = self.free[:-n_new]
        self.pos[ids] = pos
        self.buf.view(np.uint8)[pos] = np.ascontiguousarray(rows).view(np.uint8)

    def take(self, ids: np.ndarray) -> np.ndarray:
        pos = self.pos[ids]
        if (pos < 0).any():
            raise RuntimeError(f"write-back of row {int(ids[pos < 0][0])}, which was never fetched: "
                               "its parity delta cannot be computed")
        rows = self.buf[pos]
        self.pos[ids] = -1
        self.free = np.concatenate([self.free, pos])
        return rows

