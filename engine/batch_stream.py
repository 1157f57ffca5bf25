"""The deterministic batch stream shared by the planner and the trainers.

Batches are cut from a preprocessed dataset in file order (``meta.files``): batch ``t``
holds rows ``start_row + t*B .. start_row + (t+1)*B - 1``. The planner and the trainer
build the same :class:`BatchStream` from the same arguments, so they see identical
batches; that equality is what makes a lookahead plan valid for a training run.

Global embedding ids: table ``k``'s row ``r`` is ``offsets[k] + r``
(``offsets = meta.table_offsets``).
"""

from __future__ import annotations

import bisect
import copy
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dlrmflow.datasets.meta import ROW_GROUP_ROWS, DatasetMeta, read_meta


@dataclass(frozen=True)
class Batch:
    index: int
    dense: np.ndarray  # float32 [B, n_dense]
    sparse: np.ndarray  # int64 [B, n_tables], table-local ids
    labels: np.ndarray  # float32 [B]


# Rows read per call: Parquet reads cost per call, and a block's arrays are what a reader holds (a trainer holds
# one block of its slice's rows): a row group of the datasets dlrmflow writes.
READ_ROWS = ROW_GROUP_ROWS


def global_ids(sparse: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Table-local ids [B, T] -> global ids [B, T] (int64)."""
    return sparse.astype(np.int64, copy=False) + np.asarray(offsets, dtype=np.int64)[None, :]


def read_rows(
    dataset_dir: str | os.PathLike,
    meta: DatasetMeta,
    start: int,
    stop: int,
    columns: list[str],
) -> pa.Table:
    """Rows ``[start, stop)`` of the dataset (in file order), only ``columns``."""
    if not 0 <= start <= stop <= meta.rows:
        raise ValueError(f"row range [{start}, {stop}) outside the dataset's {meta.rows} rows")
    ends = np.cumsum([f.rows for f in meta.files]).tolist()
    pieces = []
    i = bisect.bisect_right(ends, start)
    pos = start
    while pos < stop:
        file_start = ends[i] - meta.files[i].rows
        lo, hi = pos - file_start, min(stop, ends[i]) - file_start
        pieces.append(_file_rows(Path(dataset_dir) / meta.files[i].name, lo, hi, columns))
        pos = file_start + hi
        i += 1
    if not pieces:
        schema = pq.read_schema(Path(dataset_dir) / meta.files[0].name)
        return pa.table({c: pa.array([], type=schema.field(c).type) for c in columns})
    return pa.concat_tables(pieces)


def _file_rows(path: Path, lo: int, hi: int, columns: list[str]) -> pa.Table:
    """Rows ``[lo, hi)`` of one Parquet file, reading only the row groups that hold them: a reader's memory
    follows the rows it asks for, not the file's size."""
    parquet = pq.ParquetFile(path)
    row_groups = parquet.metadata
    first = group_start = 0
    wanted = []
    for g in range(row_groups.num_row_groups):
        group_rows = row_groups.row_group(g).num_rows
        if group_start < hi and group_start + group_rows > lo:
            if not wanted:
                first = group_start
            wanted.append(g)
        group_start += group_rows
    table = parquet.read_row_groups(wanted, columns=columns)
    return table.slice(lo - first, hi - lo)


def _matrix(table: pa.Table, columns: list[str], dtype: type) -> np.ndarray:
    if not columns:
        return np.zeros((table.num_rows, 0), dtype=dtype)
    return np.stack([table.column(c).to_numpy() for c in columns], axis=1).astype(dtype, copy=False)


def batches_ending_by(n_rows: int, batch_size: int, end: int, *, drop_last: bool = False) -> int:
    """How many batches of a stream over rows ``[0, n_rows)`` end at or before row ``end``: every full
    batch that does, and the final partial batch (kept unless ``drop_last``) once ``end`` reaches ``n_rows``."""
    partial = not drop_last and n_rows % batch_size != 0 and end >= n_rows
    return min(end, n_rows) // batch_size + int(partial)


class BatchStream:
    """Batches of ``batch_size`` rows over ``[start_row, stop_row)`` of a dataset.

    ``drop_last`` drops a final partial batch; otherwise it is kept (smaller).
    ``sparse_only`` skips reading dense features and labels (the planner needs ids only).
    :meth:`sliced` gives the same stream of one trainer's slices.
    """

    def __init__(
        self,
        dataset_dir: str | os.PathLike,
        batch_size: int,
        *,
        drop_last: bool = False,
        start_row: int = 0,
        stop_row: int | None = None,
        sparse_only: bool = False,
        read_rows_at_once: int = READ_ROWS,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.dataset_dir = Path(dataset_dir)
        self.meta = read_meta(dataset_dir)
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.start_row = start_row
        self.stop_row = self.meta.rows if stop_row is None else stop_row
        if not 0 <= self.start_row <= self.stop_row <= self.meta.rows:
            raise ValueError(
                f"rows [{self.start_row}, {self.stop_row}) outside the dataset's {self.meta.rows} rows"
            )
        self.sparse_only = sparse_only
        self.slice_of = (0, 1)  # (rank, size): the whole batch (sliced)
        self.offsets = np.asarray(self.meta.table_offsets, dtype=np.int64)
        # Read blocks of whole batches at a time: parquet reads are cheap per row, costly per call.
        self._rows_at_once = max(batch_size, (read_rows_at_once // batch_size) * batch_size)

    def __len__(self) -> int:
        n = self.stop_row - self.start_row
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def batch_rows(self, t: int) -> tuple[int, int]:
        """Dataset row range of batch ``t``."""
        lo = self.start_row + t * self.batch_size
        return lo, min(lo + self.batch_size, self.stop_row)

    def iter_range(self, first: int, last: int) -> Iterator[Batch]:
        """Batches ``first .. last-1`` (clipped to the stream)."""
        last = min(last, len(self))
        meta = self.meta
        columns = list(meta.sparse_columns)
        if not self.sparse_only:
            columns = [meta.label_column, *meta.dense_columns, *columns]
        t = max(first, 0)
        while t < last:
            t_end = min(last, t + self._rows_at_once // self.batch_size)
            lo, _ = self.batch_rows(t)
            _, hi = self.batch_rows(t_end - 1)
            table = read_rows(self.dataset_dir, meta, lo, hi, columns)
            ranges = [self._slice_rows(u) for u in range(t, t_end)]
            lengths = [b - a for a, b in ranges]
            starts = [a - lo for a, _ in ranges]
            if self.slice_of[1] > 1:  # only this slice's rows are turned into arrays
                table = table.take(np.concatenate([np.arange(a - lo, b - lo) for a, b in ranges]))
                starts = np.cumsum([0, *lengths[:-1]]).tolist()
            sparse = _matrix(table, meta.sparse_columns, np.int64)
            if self.sparse_only:
                dense = np.zeros((table.num_rows, 0), np.float32)
                labels = np.zeros(table.num_rows, np.float32)
            else:
                dense = _matrix(table, meta.dense_columns, np.float32)
                labels = table.column(meta.label_column).to_numpy().astype(np.float32)
            for u, a, length in zip(range(t, t_end), starts, lengths, strict=True):
                yield Batch(u, dense[a:a + length], sparse[a:a + length], labels[a:a + length])
            t = t_end

    def sliced(self, rank: int, size: int) -> BatchStream:
        """The same stream, each batch's rows ``rank * b/size .. (rank + 1) * b/size - 1`` only (b: the batch's
        rows): what trainer ``rank`` of ``size`` trains."""
        if not 0 <= rank < size:
            raise ValueError(f"slice {rank} of {size} is not a slice of a batch")
        stream = copy.copy(self)
        stream.slice_of = (rank, size)
        return stream

    def _slice_rows(self, t: int) -> tuple[int, int]:
        """Dataset row range of batch ``t``'s slice (the whole batch unless :meth:`sliced`)."""
        lo, hi = self.batch_rows(t)
        rank, size = self.slice_of
        rows = (hi - lo) // size
        return lo + rank * rows, lo + (rank + 1) * rows

    def __iter__(self) -> Iterator[Batch]:
        return self.iter_range(0, len(self))
