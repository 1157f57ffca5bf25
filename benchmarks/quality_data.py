"""The data sources of benchmarks/quality.py: preprocessed datasets whose click signal differs.

    generator      the project's generator (``dlrmflow.datasets.synthetic``, tables at ``scale`` x Criteo
                   Kaggle's; benchmarks/bench_data.py): steep power-law ids (most rows on each table's first
                   values), the label a bias, 6 dense features and every table's fixed per-value effect
                   (uniform in +-0.5), summed
    first-order    another generator (below) whose label is first-order: sigmoid(FIRST_ORDER_BIAS +
                   FIRST_ORDER_SCALE * (e_a(id_a) + e_b(id_b))), the effects of the first FEW_VALUES ids of two
                   tables (C10, C24) alone; every other id and the dense features are noise
    pairwise       the same generator, the label sigmoid(PAIRWISE_BIAS + PAIRWISE_SCALE * e_a(id_a) * e_b(id_b)):
                   the product of the same two tables' effects (every id's, centred on the rows' ids), so
                   neither table alone says anything about the click
    criteo-sample  the 200 real Criteo Kaggle rows the tests ship (tests/data/criteo_kaggle_sample.csv),
                   through `dlrmflow preprocess --format criteo-csv`

The other generator: 13 dense features drawn as the project's (log-normal, Criteo's medians and spreads),
none missing; 26 categorical columns with the project's table sizes at ``scale`` (at least 3 values) and
flatter ids, as real logs have them: a power law of exponent ID_EXPONENT with an ID_TAIL share drawn uniformly
over the table, so a table's ids are seen from tens of thousands of times to once. An id's effect e(id) is a
fixed hash of the id, uniform in [-1, 1). Ids are already ranks by popularity (id 0, "missing", is unused):
the layout `dlrmflow preprocess` writes.

For the generated labels the click probability of every row is known, so the best log loss a model can reach
on the held-out rows is too: such a dataset keeps it in ``click_probability.npy``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from bench_data import synthetic_dataset

from dlrmflow.datasets import synthetic
from dlrmflow.datasets.writer import write_array_dataset

SOURCES = ("generator", "first-order", "pairwise", "criteo-sample")
CRITEO_SAMPLE = Path(__file__).resolve().parent.parent / "tests" / "data" / "criteo_kaggle_sample.csv"
PROBABILITY_FILE = "click_probability.npy"
STAMP_FILE = "bench-params.json"

ID_EXPONENT, ID_TAIL = 1.1, 0.2
MIN_TABLE_SIZE = 3
# The two tables that carry the signal (0-based: C10 and C24; 93 and 286 values at scale 0.001).
SIGNAL_TABLES = (9, 23)
FEW_VALUES = 5  # first-order: the ids 1..FEW_VALUES of each signal table have an effect (about a third of the rows)
FIRST_ORDER_BIAS, FIRST_ORDER_SCALE = -1.2, 1.5
PAIRWISE_BIAS, PAIRWISE_SCALE = -1.2, 3.0
# Keys of the ids' effects: fixed, so an id has the same effect in every dataset of a source.
EFFECT_KEYS = (0x2F6B1D4F, 0x71C3A9E5)
# What a reused dataset directory must have been made with (its stamp).
GENERATOR_CONSTANTS = [ID_EXPONENT, ID_TAIL, MIN_TABLE_SIZE, list(SIGNAL_TABLES), FEW_VALUES, FIRST_ORDER_BIAS,
                       FIRST_ORDER_SCALE, PAIRWISE_BIAS, PAIRWISE_SCALE, list(EFFECT_KEYS)]


def id_effects(ids: np.ndarray, key: int) -> np.ndarray:
    """Each id's fixed effect, uniform in [-1, 1)."""
    return synthetic.mix32(ids.astype(np.uint32), key).astype(np.float64) * (2.0 / 2**32) - 1.0


def _other_generator(rows: int, scale: float, seed: int, signal: str
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int], np.ndarray]:
    """Rows of the other generator (module docstring) with a ``signal`` ("first-order" | "pairwise") label,
    and each row's click probability."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, 47]))
    sizes = np.maximum(np.asarray(synthetic.table_cardinalities(scale)), MIN_TABLE_SIZE)
    sparse = synthetic.popularity_ranks(rng.random((rows, synthetic.N_SPARSE)), sizes, ID_EXPONENT, ID_TAIL)
    z = rng.standard_normal((rows, synthetic.N_DENSE))
    counts = np.maximum(np.rint(np.expm1(synthetic.DENSE_MU + synthetic.DENSE_SIGMA * z)), 0)
    dense = np.log1p(counts).astype(np.float32)
    a, b = (id_effects(sparse[:, k], key) for k, key in zip(SIGNAL_TABLES, EFFECT_KEYS, strict=True))
    if signal == "first-order":
        few_a, few_b = (sparse[:, k] <= FEW_VALUES for k in SIGNAL_TABLES)
        logit = FIRST_ORDER_BIAS + FIRST_ORDER_SCALE * (np.where(few_a, a, 0.0) + np.where(few_b, b, 0.0))
    else:
        logit = PAIRWISE_BIAS + PAIRWISE_SCALE * (a - a.mean()) * (b - b.mean())
    probability = 1.0 / (1.0 + np.exp(-logit))
    labels = (rng.random(rows) < probability).astype(np.int8)
    return labels, dense, sparse.astype(np.int32), [int(n) + 1 for n in sizes], probability


def _generated(path: Path, rows: int, scale: float, seed: int, source: str) -> Path:
    """The other generator's rows with a ``source`` label (first-order | pairwise), reused when ``path``
    holds them already."""
    params = {"source": source, "rows": rows, "scale": scale, "seed": seed, "generator": GENERATOR_CONSTANTS}
    stamp = path / STAMP_FILE
    if stamp.is_file() and json.loads(stamp.read_text()) == params:
        return path
    labels, dense, sparse, cards, probability = _other_generator(rows, scale, seed, source)
    write_array_dataset(path, labels, dense, sparse, cards)
    np.save(path / PROBABILITY_FILE, probability)
    stamp.write_text(json.dumps(params))
    return path


def criteo_sample_dataset(path: Path) -> Path:
    """The tests' 200 real Criteo rows, preprocessed (reused when ``path`` holds them already)."""
    from dlrmflow.datasets.preprocess import preprocess

    params = {"source": "criteo-sample"}
    stamp = path / STAMP_FILE
    if stamp.is_file() and json.loads(stamp.read_text()) == params:
        return path
    preprocess([str(CRITEO_SAMPLE)], path, fmt="criteo-csv", force=True)
    stamp.write_text(json.dumps(params))
    return path


def source_dataset(source: str, work: Path, rows: int, scale: float, seed: int = 0) -> Path:
    """The dataset of ``source`` (one of SOURCES) under ``work``, made unless it is there already."""
    if source == "criteo-sample":
        return criteo_sample_dataset(work / "data-criteo-sample")
    if source == "generator":
        return synthetic_dataset(work / f"data-generator-{rows}-{scale}-{seed}", rows, scale, seed=seed)
    if source not in SOURCES:
        raise ValueError(f"unknown data source {source!r}; choose one of {', '.join(SOURCES)}")
    return _generated(work / f"data-{source}-{rows}-{scale}-{seed}", rows, scale, seed, source)


def click_probability(dataset: Path) -> np.ndarray | None:
    """The generator's click probability of every row of ``dataset``, in its stored order; None when unknown."""
    path = Path(dataset) / PROBABILITY_FILE
    return np.load(path) if path.is_file() else None
