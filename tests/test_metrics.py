"""AUC and log loss against brute-force definitions; their mergeable summaries against the whole."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dlrmflow.engine.training import metrics
from dlrmflow.engine.training.metrics import (
    LOG_LOSS_EPS,
    AucCounts,
    LogLossSum,
    ScoreSummary,
    SummaryMerger,
    log_loss,
    log_loss_terms,
    roc_auc,
)


def auc_by_pairs(labels, scores) -> float:
    """P(positive scores above negative), ties 1/2, by enumerating every (positive, negative) pair."""
    pos = [s for y, s in zip(labels, scores, strict=True) if y == 1]
    neg = [s for y, s in zip(labels, scores, strict=True) if y == 0]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def log_loss_by_loop(labels, probs) -> float:
    total = 0.0
    for y, p in zip(labels, probs, strict=True):
        p = min(max(p, LOG_LOSS_EPS), 1 - LOG_LOSS_EPS)
        total += -math.log(p) if y == 1 else -math.log(1 - p)
    return total / len(labels)


def test_fixed_inputs():
    labels, scores = [0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8]
    assert roc_auc(labels, scores) == auc_by_pairs(labels, scores) == 0.75
    assert log_loss(labels, scores) == pytest.approx(log_loss_by_loop(labels, scores), rel=1e-12)
    assert roc_auc([1, 0], [0.3, 0.3]) == 0.5  # a tie is half a win
    assert roc_auc([0, 1, 1], [0.9, 0.1, 0.2]) == 0.0


@pytest.mark.parametrize("seed", range(30))
def test_random_inputs_with_ties_match_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 60))
    labels = rng.integers(0, 2, n)
    labels[0], labels[1] = 0, 1  # both classes present
    # Few distinct values -> many ties; sometimes exact 0/1 probabilities (clipped by log loss).
    scores = rng.integers(0, int(rng.integers(1, 6)) + 1, n) / 5.0
    assert roc_auc(labels, scores) == pytest.approx(auc_by_pairs(labels, scores), abs=1e-12)
    assert log_loss(labels, scores) == pytest.approx(log_loss_by_loop(labels, scores), rel=1e-12)


def test_auc_is_undefined_without_both_classes():
    assert math.isnan(roc_auc([1, 1, 1], [0.1, 0.2, 0.3]))
    assert math.isnan(roc_auc([0, 0], [0.1, 0.2]))


def test_length_mismatch_is_an_error():
    with pytest.raises(ValueError, match="differ in length"):
        roc_auc([0, 1], [0.5])
    with pytest.raises(ValueError, match="differ in length"):
        log_loss([0, 1], [0.5])


# ---- the mergeable summaries --------------------------------------------------------------------------


def random_partition(rng: np.random.Generator, n: int) -> list[np.ndarray]:
    """Row indices ``0..n-1`` shuffled and cut into 1..12 parts, some of them empty."""
    cuts = np.sort(rng.integers(0, n + 1, int(rng.integers(0, 12))))
    return np.split(rng.permutation(n), cuts)


def random_scores(rng: np.random.Generator, n: int, seed: int) -> np.ndarray:
    """float32 probabilities (what a model gives), with many ties in every other case; float64 in every
    third (the summaries keep the scores' own type)."""
    if seed % 2:
        scores = (rng.integers(0, int(rng.integers(1, 40)) + 1, n) / 40.0).astype(np.float32)
    else:
        scores = rng.random(n).astype(np.float32)
    return scores.astype(np.float64) if seed % 3 == 0 else scores


@pytest.mark.parametrize("seed", range(60))
def test_merging_any_partition_gives_the_whole_rows_metrics(seed):
    """AUC: bit-equal to roc_auc on the whole (a ratio of integer counts, and roc_auc's float64 rank sums are
    exact at these sizes). Log loss: bit-equal to math.fsum over every row's loss / n, the exact sum rounded
    once (log_loss's np.mean rounds its pairwise partial sums, so it may differ from that by a few ulps:
    compared here with a relative tolerance only). Whatever the parts and the order they merge in."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 2000))
    labels = rng.integers(0, 2, n)
    labels[:2] = (0, 1)
    if seed % 5 == 0:
        labels[:] = 1  # one class only: AUC undefined
    scores = random_scores(rng, n, seed)
    if seed % 7 == 0:
        scores[: n // 3] = 0.0 if seed % 2 else 1.0  # probabilities at 0 or 1: clipped by the log loss
    merger = SummaryMerger()
    for part in random_partition(rng, n):
        merger.add(ScoreSummary.of(labels[part], scores[part]))
    merged = merger.result()

    expected_auc = roc_auc(labels, scores)
    assert merged.auc() is None if math.isnan(expected_auc) else merged.auc() == expected_auc
    assert merged.log_loss() == math.fsum(log_loss_terms(labels, scores)) / n
    assert merged.log_loss() == pytest.approx(log_loss(labels, scores), rel=1e-13)
    assert (merged.rows, merged.positives) == (n, int(labels.sum()))
    whole = ScoreSummary.of(labels, scores).counts
    for field in ("scores", "positives", "negatives"):
        assert np.array_equal(getattr(merged.counts, field), getattr(whole, field)), field


@pytest.mark.parametrize("seed", range(10))
def test_the_counts_give_the_pairwise_auc(seed):
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(2, 80))
    labels = rng.integers(0, 2, n)
    labels[:2] = (0, 1)
    scores = rng.integers(0, 6, n) / 5.0
    assert AucCounts.of(labels, scores).auc() == pytest.approx(auc_by_pairs(labels, scores), abs=1e-12)


def test_the_exact_sum_is_fsums_value_whatever_the_magnitudes():
    """Sums kept as integers in units of 2**-1074: subnormals, signs and magnitudes far apart included."""
    rng = np.random.default_rng(7)
    for _ in range(50):
        values = rng.standard_normal(500) * 10.0 ** rng.integers(-320, 300, 500)
        values = values[np.isfinite(values)]
        parts = np.array_split(values, 4)
        units = sum(metrics._exact_units(p) for p in parts)
        assert metrics._units_to_float(units) == math.fsum(values)
    assert metrics._units_to_float(metrics._exact_units(np.array([5e-324, -5e-324, 1e308, 1e308]))) == math.inf


def test_the_constant_prediction_and_the_edges():
    labels = np.array([1, 0, 0, 0, 1, 0, 0])
    rate = labels.mean()
    constant = LogLossSum.constant(int(labels.sum()), len(labels))
    assert constant.value() == math.fsum(log_loss_terms(labels, np.full(len(labels), rate))) / len(labels)
    assert math.isnan(LogLossSum().value()) and math.isnan(LogLossSum.constant(0, 0).value())
    assert ScoreSummary.empty().auc() is None and ScoreSummary.empty().log_loss() is None
    assert SummaryMerger().result().rows == 0
    nan = ScoreSummary.of([0, 1], [0.5, float("nan")])
    assert math.isnan(nan.merged([nan, ScoreSummary.of([1], [0.2])]).log_loss())
    with pytest.raises(ValueError, match="0 or 1"):
        AucCounts.of([0, 2], [0.1, 0.2])
    with pytest.raises(ValueError, match="differ in length"):
        ScoreSummary.of([0, 1], [0.5])
