"""Write a dataset directory from in-memory arrays (tests, small experiments, imports).

The preprocess flow writes the same layout from raw files; this is the direct path for data
that is already numeric. The fingerprint is a content hash of the arrays.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dlrmflow.datasets.meta import ROW_GROUP_ROWS, DatasetMeta, PartFile, write_meta


def arrow_table(
    labels: np.ndarray,
    dense: np.ndarray,
    sparse: np.ndarray,
    dense_columns: list[str],
    sparse_columns: list[str],
    label_column: str = "label",
) -> pa.Table:
    columns = {label_column: pa.array(np.asarray(labels, dtype=np.int8))}
    for j, name in enumerate(dense_columns):
        columns[name] = pa.array(np.ascontiguousarray(dense[:, j], dtype=np.float32))
    for j, name in enumerate(sparse_columns):
        columns[name] = pa.array(np.ascontiguousarray(sparse[:, j], dtype=np.int32))
    return pa.table(columns)


def write_array_dataset(
    output: str | os.PathLike,
    labels: np.ndarray,
    dense: np.ndarray,
    sparse: np.ndarray,
    cardinalities: list[int],
    *,
    rows_per_file: int = 1 << 20,
    source_format: str = "arrays",
) -> DatasetMeta:
    """Write ``labels`` [N], ``dense`` [N, D] float32, ``sparse`` [N, T] ids as a dataset."""
    n = len(labels)
    if dense.shape[0] != n or sparse.shape[0] != n:
        raise ValueError(f"row counts differ: labels {n}, dense {dense.shape[0]}, sparse {sparse.shape[0]}")
    if sparse.shape[1] != len(cardinalities):
        raise ValueError(f"{sparse.shape[1]} categorical columns but {len(cardinalities)} cardinalities")
    if n and ((sparse.min(axis=0) < 0).any() or (sparse.max(axis=0) >= np.asarray(cardinalities)).any()):
        raise ValueError("categorical ids must lie in [0, cardinality) of their table")
    out = Path(output)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    dense_columns = [f"I{j + 1}" for j in range(dense.shape[1])]
    sparse_columns = [f"C{j + 1}" for j in range(sparse.shape[1])]
    digest = hashlib.sha256()
    files = []
    for i, lo in enumerate(range(0, max(n, 1), rows_per_file)):
        hi = min(lo + rows_per_file, n)
        table = arrow_table(labels[lo:hi], dense[lo:hi], sparse[lo:hi], dense_columns, sparse_columns)
        name = f"part-{i:05d}.parquet"
        pq.write_table(table, out / name, row_group_size=ROW_GROUP_ROWS)
        files.append(PartFile(name, hi - lo))
    for arr in (labels, dense, sparse):
        digest.update(np.ascontiguousarray(arr).tobytes())
    meta = DatasetMeta(
        source_format=source_format,
        rows=n,
        label_column="label",
        dense_columns=dense_columns,
        sparse_columns=sparse_columns,
        cardinalities=[int(c) for c in cardinalities],
        files=files,
        rejected_rows=0,
        rejected_by_reason={},
        transform={},
        inputs=[],
        fingerprint=digest.hexdigest(),
    )
    write_meta(out, meta)
    return meta
