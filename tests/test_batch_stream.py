"""The batch stream reads the row groups that hold the rows it wants, whatever the block it reads at once, and
gives the same batches as the dataset's arrays."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from dlrmflow.datasets import writer
from dlrmflow.datasets.writer import write_array_dataset
from dlrmflow.engine.batch_stream import BatchStream, read_rows


@pytest.fixture
def dataset(tmp_path, monkeypatch):
    """130 rows in two files (100 + 30) of row groups of 16 rows."""
    monkeypatch.setattr(writer, "ROW_GROUP_ROWS", 16)
    rng = np.random.default_rng(0)
    rows = 130
    labels = (rng.random(rows) < 0.4).astype(np.int8)
    dense = rng.standard_normal((rows, 2)).astype(np.float32)
    sparse = rng.integers(0, 50, (rows, 3)).astype(np.int32)
    path = tmp_path / "data"
    write_array_dataset(path, labels, dense, sparse, [50, 50, 50], rows_per_file=100)
    assert [pq.ParquetFile(path / f"part-{i:05d}.parquet").metadata.num_row_groups for i in (0, 1)] == [7, 2]
    return path, labels, dense, sparse


@pytest.mark.parametrize("block", [1, 16, 37, 1 << 16])
@pytest.mark.parametrize("start_row", [0, 5, 99])
def test_batches_equal_the_arrays_whatever_the_block(dataset, block, start_row):
    path, labels, dense, sparse = dataset
    stream = BatchStream(path, 8, start_row=start_row, read_rows_at_once=block)
    batches = list(stream)
    assert sum(len(b.labels) for b in batches) == 130 - start_row
    got = np.concatenate([b.sparse for b in batches])
    assert np.array_equal(got, sparse[start_row:].astype(np.int64))
    assert np.array_equal(np.concatenate([b.dense for b in batches]), dense[start_row:])
    assert np.array_equal(np.concatenate([b.labels for b in batches]), labels[start_row:].astype(np.float32))


def test_a_read_touches_only_the_row_groups_of_its_rows(dataset, monkeypatch):
    path, _, _, sparse = dataset
    read = []
    original = pq.ParquetFile.read_row_groups

    def recording(self, row_groups, *args, **kwargs):
        read.append(list(row_groups))
        return original(self, row_groups, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_groups", recording)
    from dlrmflow.datasets.meta import read_meta

    table = read_rows(path, read_meta(path), 40, 110, ["C1"])
    assert read == [[2, 3, 4, 5, 6], [0]]  # rows 32..99 of the first file, 0..15 of the second
    assert np.array_equal(table.column("C1").to_numpy(), sparse[40:110, 0])
