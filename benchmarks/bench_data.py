"""Datasets shared by the benchmark scripts (importable because they run as `python benchmarks/X.py`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dlrmflow.datasets import synthetic
from dlrmflow.datasets.writer import write_array_dataset


def synthetic_dataset(path: Path, rows: int, scale: float, seed: int = 0) -> Path:
    """Synthetic Criteo rows in the preprocessed layout: id 0 = missing, ids by popularity rank,
    dense log(max(x, 0) + 1) with missing -> 0 (what `dlrmflow preprocess` writes).

    Skips the TSV round trip, and reuses ``path`` when it was made with the same parameters.
    """
    params = {"rows": rows, "scale": scale, "seed": seed}
    stamp = path / "bench-params.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == params:
        return path
    arrays = synthetic.generate_arrays(0, rows, seed=seed, scale=scale)
    dense = np.log1p(np.maximum(arrays["dense"], 0)).astype(np.float32)
    dense[arrays["dense_missing"]] = 0.0
    sparse = np.where(arrays["cat_missing"], 0, arrays["ranks"]).astype(np.int32)
    cards = [c + 1 for c in synthetic.max_cardinalities(scale)]
    write_array_dataset(path, arrays["labels"].astype(np.int8), dense, sparse, cards)
    stamp.write_text(json.dumps(params))
    return path
